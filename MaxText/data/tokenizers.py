"""Tokenizers behind one small protocol: byte-level, HuggingFace and SentencePiece.

Every tokenizer exposes ``encode(text) -> list[int]``, ``decode(ids) -> str``,
``vocab_size``, ``pad_id``, ``bos_id`` and ``eos_id``. ``bos_id``/``eos_id`` are
``None`` when the tokenizer has no such token. Tokenizers loaded from files keep
only the path when pickled (Grain worker processes reload them lazily).
"""

from __future__ import annotations

import abc

import json
import os
from typing import Optional, Protocol, Sequence, runtime_checkable

from MaxText.config.schema import choices
from MaxText.data.errors import DataError

TOKENIZER_TYPES = choices("tokenizer_type")

# Candidate special-token strings, most common spelling first.
_BOS_CANDIDATES = ("<s>", "<bos>", "<|begin_of_text|>", "<|startoftext|>", "[BOS]", "[CLS]")
_EOS_CANDIDATES = ("</s>", "<eos>", "<|end_of_text|>", "<|endoftext|>", "<|im_end|>", "[EOS]",
                   "[SEP]")
_PAD_CANDIDATES = ("<pad>", "[PAD]", "<|pad|>")


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
  vocab_size = 256 + OFFSET
  pad_id = 0
  bos_id = 1
  eos_id = 2

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
    self._impl = None
    self._load()  # Load eagerly once so errors surface at construction time.

  @abc.abstractmethod
  def _load(self):
    """Sets `self._impl` from `self.path`."""

  @property
  def impl(self):
    if self._impl is None:
      self._load()
    return self._impl

  def __getstate__(self):
    state = dict(self.__dict__)
    state["_impl"] = None
    return state

  def __setstate__(self, state):
    self.__dict__.update(state)

  def __repr__(self) -> str:
    return f"{type(self).__name__}({self.path!r})"


class HFTokenizer(_LazyFileTokenizer):
  """A HuggingFace ``tokenizers`` tokenizer loaded from a local ``tokenizer.json``.

  bos/eos come from a ``tokenizer_config.json`` next to the file if it names them,
  else from well-known special-token spellings in the vocabulary (``<s>``, ``</s>``,
  ``<|endoftext|>``, ...). pad is ``<pad>`` (or ``[PAD]``/``<|pad|>``) if present, else 0.
  """

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
    named = self._config_special_tokens()
    self.bos_id = _first_id(vocab, named.get("bos_token"), _BOS_CANDIDATES)
    self.eos_id = _first_id(vocab, named.get("eos_token"), _EOS_CANDIDATES)
    pad = _first_id(vocab, named.get("pad_token"), _PAD_CANDIDATES)
    self.pad_id = 0 if pad is None else pad

  def _config_special_tokens(self) -> dict:
    """Reads bos/eos/pad token strings from a sibling tokenizer_config.json, if any."""
    cfg_path = os.path.join(os.path.dirname(self.path), "tokenizer_config.json")
    if not os.path.isfile(cfg_path):
      return {}
    try:
      with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    except (OSError, ValueError):
      return {}
    out = {}
    for key in ("bos_token", "eos_token", "pad_token"):
      value = cfg.get(key)
      if isinstance(value, dict):  # {"content": "<s>", ...} form.
        value = value.get("content")
      if isinstance(value, str):
        out[key] = value
    return out

  def encode(self, text: str) -> list[int]:
    return self.impl.encode(text, add_special_tokens=False).ids

  def decode(self, ids: Sequence[int]) -> str:
    return self.impl.decode([int(i) for i in ids])


def _first_id(vocab: dict, preferred: Optional[str], candidates: Sequence[str]) -> Optional[int]:
  """Id of `preferred` if in `vocab`, else of the first candidate in `vocab`, else None."""
  for token in ((preferred,) if preferred else ()) + tuple(candidates):
    if token in vocab:
      return int(vocab[token])
  return None


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

  def encode(self, text: str) -> list[int]:
    return self.impl.EncodeAsIds(text)

  def decode(self, ids: Sequence[int]) -> str:
    return self.impl.DecodeIds([int(i) for i in ids])


def make_tokenizer(tokenizer_type: str, tokenizer_path: str = "") -> Tokenizer:
  """Builds the tokenizer named by the `tokenizer_type` / `tokenizer_path` config keys.

  Raises:
    DataError: unknown type, or the path is missing for a file-based tokenizer.
  """
  if tokenizer_type == "byte":
    return ByteTokenizer()
  if tokenizer_type not in TOKENIZER_TYPES:
    raise DataError(f"tokenizer_type '{tokenizer_type}' is not one of {list(TOKENIZER_TYPES)}")
  path = os.path.expanduser(tokenizer_path or "")
  if not path:
    raise DataError(f"tokenizer_path is empty but tokenizer_type '{tokenizer_type}' needs a file")
  if not os.path.isfile(path):
    raise DataError(f"tokenizer_path '{tokenizer_path}' does not exist")
  if tokenizer_type == "huggingface":
    return HFTokenizer(path)
  return SentencePieceTokenizer(path)
