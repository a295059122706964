"""Tokenizers behind one small protocol: byte-level, HuggingFace and SentencePiece.

Every tokenizer exposes ``encode(text) -> list[int]``, ``decode(ids) -> str``,
``vocab_size``, ``pad_id``, ``bos_id`` and ``eos_id``. ``bos_id``/``eos_id`` are
``None`` when the tokenizer has no such token (the concrete classes also say ``named_pad_id``:
the pad the tokenizer names, None when none, where ``pad_id`` is then 0). Tokenizers loaded from files keep
only the path when pickled (Grain worker processes reload them lazily).

Which tokenizer (`resolve`): ``tokenizer_type=auto`` (the default) is the byte tokenizer without
a ``tokenizer_path``, else the kind of the file it names: ``*.json`` → huggingface,
``*.model`` → sentencepiece; a directory means its ``tokenizer.json`` (else its one ``*.model``).
An explicit type that contradicts the file is refused, as is ``byte`` with a path.

Special tokens are never guessed from spellings: a HuggingFace tokenizer's bos/eos/pad are the
``bos_token``/``eos_token``/``pad_token`` of the ``tokenizer_config.json`` next to it, overridden
by ``special_tokens_map.json`` when the config has no ``added_tokens_decoder`` (what
transformers' ``from_pretrained`` does); a SentencePiece model's come from the model itself. A
missing bos/eos is ``None`` (``add_bos``/``add_eos`` then refuse, naming the keys); a missing pad
is id 0 (padding is masked out of the loss, so its id never matters).
"""

from __future__ import annotations

import abc
import glob
import json
import os
from typing import Any, Optional, Protocol, Sequence, runtime_checkable

from MaxText.config.schema import choices
from MaxText.data.errors import DataError

TOKENIZER_TYPES = choices("tokenizer_type")
HF_TOKENIZER_FILE = "tokenizer.json"
SPECIAL_TOKEN_FILES = ("tokenizer_config.json", "special_tokens_map.json")
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token")


@runtime_checkable
class Tokenizer(Protocol):
  """What the pipeline needs from a tokenizer."""

  vocab_size: int
  pad_id: int
  bos_id: Optional[int]
  eos_id: Optional[int]

  def encode(self, text: str) -> list[int]:
    ...

  def decode(self, ids: Sequence[int]) -> str:
    ...


class ByteTokenizer:
  """UTF-8 bytes as tokens: 0=pad, 1=bos, 2=eos, byte b -> b + 3 (259 ids)."""

  OFFSET = 3
  SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")   # ids 0, 1, 2 by name (labels, Hugging Face export)
  vocab_size = 256 + OFFSET
  pad_id = 0
  bos_id: Optional[int] = 1
  eos_id: Optional[int] = 2
  named_pad_id = 0

  def encode(self, text: str) -> list[int]:
    return [b + self.OFFSET for b in text.encode("utf-8")]

  def decode(self, ids: Sequence[int]) -> str:
    data = bytes(int(i) - self.OFFSET for i in ids if self.OFFSET <= int(i) < self.vocab_size)
    return data.decode("utf-8", errors="replace")

  def __repr__(self) -> str:
    return "ByteTokenizer()"


class _LazyFileTokenizer(abc.ABC):
  """Base for tokenizers loaded from a file: pickles as its path, loads on first use."""

  def __init__(self, path: str):
    self.path = path
    self._impl: Any = None   # the library's tokenizer object (each subclass's `_load`)
    self._load()  # Load eagerly once so errors surface at construction time.

  @abc.abstractmethod
  def _load(self):
    """Sets `self._impl` from `self.path`."""

  @property
  def impl(self) -> Any:
    if self._impl is None:
      self._load()
    return self._impl

  def __getstate__(self):
    state = dict(self.__dict__)
    state["_impl"] = None
    return state

  def __setstate__(self, state):
    vars(self).update(state)

  def __repr__(self) -> str:
    return f"{type(self).__name__}({self.path!r})"


class HFTokenizer(_LazyFileTokenizer):
  """A HuggingFace ``tokenizers`` tokenizer loaded from a local ``tokenizer.json``; special tokens
  from the ``tokenizer_config.json`` / ``special_tokens_map.json`` next to it (module docstring)."""

  def _load(self):
    import tokenizers  # pylint: disable=g-import-not-at-top
    try:
      self._impl = tokenizers.Tokenizer.from_file(self.path)
    except Exception as e:  # tokenizers raises a bare Exception on bad files.
      raise DataError(f"tokenizer_path '{self.path}' is not a valid tokenizer.json: {e}") from e
    if "vocab_size" in self.__dict__:
      return  # Special ids already resolved (reload in a worker process).
    vocab = self._impl.get_vocab(with_added_tokens=True)
    self.vocab_size = self._impl.get_vocab_size(with_added_tokens=True)
    named, where = special_tokens(os.path.dirname(self.path))
    ids = {}
    for key in SPECIAL_TOKEN_KEYS:
      token = named.get(key)
      if token is not None and token not in vocab:
        raise DataError(f"tokenizer_path: {where[key]} names {key}={token!r}, which is not in the "
                        f"vocabulary of {self.path}")
      ids[key] = None if token is None else int(vocab[token])
    self.bos_id, self.eos_id = ids["bos_token"], ids["eos_token"]
    self.pad_id = 0 if ids["pad_token"] is None else ids["pad_token"]
    self.named_pad_id = ids["pad_token"]   # None: the files name no pad token

  def encode(self, text: str) -> list[int]:
    return self.impl.encode(text, add_special_tokens=False).ids

  def decode(self, ids: Sequence[int]) -> str:
    return self.impl.decode([int(i) for i in ids])


def token_label(tok, token_id: int) -> str:
  """A token's own text for a label: a special token by its name (`<bos>`: the byte tokenizer's
  SPECIAL_TOKENS, a Hugging Face or SentencePiece token's own string), `<id>` where there is no
  text (no tokenizer, or an id the tokenizer does not spell)."""
  t = int(token_id)
  text = ""
  if isinstance(tok, ByteTokenizer):
    text = tok.SPECIAL_TOKENS[t] if 0 <= t < tok.OFFSET else tok.decode([t])
  elif isinstance(tok, HFTokenizer):
    text = tok.impl.decode([t], skip_special_tokens=False)
  elif isinstance(tok, SentencePieceTokenizer):
    text = tok.decode([t]) or (tok.impl.IdToPiece(t) if 0 <= t < tok.vocab_size else "")
  elif tok is not None:
    text = tok.decode([t])
  return text or f"<{t}>"


def json_object(path: str) -> dict:
  """A tokenizer folder's JSON file (tokenizer_config.json, ...); DataError naming it when it is
  not a readable JSON object."""
  try:
    with open(path, encoding="utf-8") as f:
      value = json.load(f)
  except (OSError, ValueError) as e:
    raise DataError(f"tokenizer_path: {path} cannot be read as JSON: {e}") from e
  if not isinstance(value, dict):
    raise DataError(f"tokenizer_path: {path} does not hold a JSON object")
  return value


def special_tokens(folder: str, keys: Sequence[str] = SPECIAL_TOKEN_KEYS
                   ) -> tuple[dict[str, str], dict[str, str]]:
  """({key: token string} for `keys` (bos_token, eos_token, pad_token), {key: the file that set
  it}) as transformers reads them: tokenizer_config.json, then special_tokens_map.json over it
  unless the config has `added_tokens_decoder` (transformers 5 ignores the map then)."""
  found, where, config = {}, {}, {}
  for name in SPECIAL_TOKEN_FILES:
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
      continue
    values = json_object(path)
    if name == "tokenizer_config.json":
      config = values
    elif "added_tokens_decoder" in config:
      continue
    for key in keys:
      value = values.get(key)
      if isinstance(value, dict):  # {"content": "<s>", ...}: an AddedToken
        value = value.get("content")
      if isinstance(value, str):
        found[key], where[key] = value, path
  return found, where


class SentencePieceTokenizer(_LazyFileTokenizer):
  """A SentencePiece model loaded from a local ``.model`` file.

  Ids the model disables (reported as -1) become ``None`` (bos/eos) or 0 (pad).
  """

  def _load(self):
    import sentencepiece  # pylint: disable=g-import-not-at-top
    proc = sentencepiece.SentencePieceProcessor()
    try:
      proc.Load(self.path)
    except (OSError, RuntimeError) as e:
      raise DataError(
          f"tokenizer_path '{self.path}' is not a valid SentencePiece model: {e}") from e
    self._impl = proc
    self.vocab_size = int(proc.GetPieceSize())
    self.bos_id = proc.bos_id() if proc.bos_id() >= 0 else None
    self.eos_id = proc.eos_id() if proc.eos_id() >= 0 else None
    self.pad_id = proc.pad_id() if proc.pad_id() >= 0 else 0
    self.named_pad_id = proc.pad_id() if proc.pad_id() >= 0 else None

  def encode(self, text: str) -> list[int]:
    return self.impl.EncodeAsIds(text)

  def decode(self, ids: Sequence[int]) -> str:
    return self.impl.DecodeIds([int(i) for i in ids])


def is_absent(tokenizer_type: str, tokenizer_path: str) -> bool:
  """A real tokenizer's type without its file: the resolved keys of a run that tokenizes nothing
  from a checkpoint that carries no tokenizer files (`resolve/tokenizer_setup.py`)."""
  return tokenizer_type in ("huggingface", "sentencepiece") and not tokenizer_path


def resolve(tokenizer_type: str, tokenizer_path: str) -> tuple[str, str, str]:
  """(type, file, how it was chosen) for the `tokenizer_type` / `tokenizer_path` keys (module
  docstring). Raises DataError naming the key when they are missing, unknown or contradict."""
  if tokenizer_type not in TOKENIZER_TYPES:
    raise DataError(f"tokenizer_type '{tokenizer_type}' is not one of {list(TOKENIZER_TYPES)}")
  path = os.path.expanduser(tokenizer_path or "")
  if not path:
    if tokenizer_type in ("auto", "byte"):
      return "byte", "", "built in"
    raise DataError(f"tokenizer_path is empty but tokenizer_type '{tokenizer_type}' needs a file")
  if tokenizer_type == "byte":
    raise DataError(f"tokenizer_type='byte' (built in) contradicts tokenizer_path="
                    f"'{tokenizer_path}'; leave tokenizer_type unset (auto) to use that file")
  if not os.path.exists(path):
    raise DataError(f"tokenizer_path '{tokenizer_path}' does not exist")
  how = f"tokenizer_type={tokenizer_type}"
  if os.path.isdir(path):
    path, kind = _file_in(path, tokenizer_type, tokenizer_path)
    how += f"; {os.path.basename(path)} of the directory {tokenizer_path}"
  else:
    kind = _kind_of(path)
  if tokenizer_type == "auto":
    if kind is None:
      raise DataError(f"tokenizer_path '{tokenizer_path}': cannot tell the tokenizer type from the "
                      "file name (a HuggingFace tokenizer.json ends in .json, a SentencePiece "
                      "model in .model); set tokenizer_type=huggingface or sentencepiece")
    return kind, path, how + f"; inferred from the file name: {kind}"
  if kind is not None and kind != tokenizer_type:
    raise DataError(f"tokenizer_type='{tokenizer_type}' contradicts tokenizer_path='{path}', which "
                    f"is a {kind} file; leave tokenizer_type unset (auto) or fix one of them")
  return tokenizer_type, path, how


def _kind_of(path: str) -> Optional[str]:
  if path.endswith(".json"):
    return "huggingface"
  if path.endswith(".model"):
    return "sentencepiece"
  return None


def _file_in(folder: str, tokenizer_type: str, given: str) -> tuple[str, str]:
  """The tokenizer file of a directory (a Hugging Face model or tokenizer folder)."""
  hf = os.path.join(folder, HF_TOKENIZER_FILE)
  models = sorted(glob.glob(os.path.join(glob.escape(folder), "*.model")))
  if tokenizer_type in ("auto", "huggingface") and os.path.isfile(hf):
    return hf, "huggingface"
  if tokenizer_type in ("auto", "sentencepiece") and len(models) == 1:
    return models[0], "sentencepiece"
  want = {"auto": f"{HF_TOKENIZER_FILE} or one *.model file", "huggingface": HF_TOKENIZER_FILE,
          "sentencepiece": "one *.model file"}[tokenizer_type]
  found = sorted(os.listdir(folder))
  raise DataError(f"tokenizer_path '{given}' is a directory without {want} "
                  f"(it holds: {', '.join(found[:12]) or 'nothing'}"
                  f"{', ...' if len(found) > 12 else ''})")


def make_tokenizer(tokenizer_type: str, tokenizer_path: str = ""
                   ) -> ByteTokenizer | HFTokenizer | SentencePieceTokenizer:
  """Builds the tokenizer the `tokenizer_type` / `tokenizer_path` config keys name (`resolve`).

  Raises:
    DataError: unknown type, a missing or contradicting path, an unreadable file.
  """
  kind, path, _ = resolve(tokenizer_type, tokenizer_path)
  if kind == "byte":
    return ByteTokenizer()
  if kind == "huggingface":
    return HFTokenizer(path)
  return SentencePieceTokenizer(path)
