"""Supervised fine-tuning data (`sft=true`): chat records → token rows whose loss mask is the
assistant's tokens.

A record is one jsonl line holding OpenAI-style `messages` ([{"role": "system" | "user" |
"assistant" | "tool", "content": str}, ...], multi-turn), or `prompt` and `completion` (strings:
one user and one assistant message; or lists of messages); optionally `tools` (JSON schemas of
the functions the model may call) and `chat_template_kwargs` (the template's own variables, e.g.
enable_thinking), handed to the template as transformers' `apply_chat_template(tools=,
**kwargs)` hands them. The tokenizer's own chat template (or
`chat_template_path`) renders it as transformers' `apply_chat_template` does
(data/chat_template.py), and the text is tokenized once, without added special tokens (the
template writes them; `add_bos` / `add_eos` do not apply).

Which characters are the assistant's:
  * a template with `{% generation %}` blocks: their bodies (transformers'
    `return_assistant_tokens_mask`);
  * otherwise, per assistant message i: from the end of the rendering of messages[:i] with the
    generation prompt (which must be a prefix of the whole rendering) to the end of the message's
    content, plus the template's end-of-turn text when it follows (what the template writes after
    an assistant message's content: "<|im_end|>", "<end_of_turn>", ...).
A token is the assistant's when any of its characters is. Target t is in the loss when token t+1
is the assistant's (`sft_train_on_completion_only`; false: every target).

Rows: each conversation's (input, target) pairs; one longer than max_target_length pairs is
truncated to its first max_target_length pairs or dropped (`sft_overlong`), and counted (stderr
and the iterator state); one left with no target in the loss is dropped and counted too. Then
first-fit packing (no conversation is split across rows; segment ids keep conversations apart),
or one conversation per row without `packing`. `targets_segmentation` is the loss mask: the
segment id where the target counts, 0 elsewhere. A record without `messages` (or prompt /
completion), with an unknown role or a message the template refuses is a bad record
(data/bad_records.py: counted, at most max_bad_records, exit 3 beyond).
"""
from __future__ import annotations

import os
import sys
from typing import Any

import grain
import numpy as np

from MaxText.data import bad_records, chat_template, file_readers, media_rows, sources
from MaxText.data.bad_records import BadRecord
from MaxText.data.batch import MEDIA_KEYS
from MaxText.data.errors import DataError
from MaxText.data.multimodal.errors import MediaError
from MaxText.data.multimodal.processor import Processor, media_of_messages

ROLES = ("system", "user", "assistant", "tool")
PART_TYPES = ("text", "image", "audio")   # content parts of a user / system message (media_rows.py)
_MARKS = ("\ue000", "\ue001")            # around {% generation %} bodies while rendering
_PROBE = ("\ue002", "\ue003")            # contents of the end-of-turn probe conversation


# ---- the template ---------------------------------------------------------------------------------
class ChatFormat:
  """A chat template and the special tokens it sees; renders a conversation with the character
  spans of the assistant's text."""

  def __init__(self, template: str, tokens: dict[str, str]):
    self.template, self.tokens = template, tokens
    self.tagged = "generation" in template and "endgeneration" in template
    self.end_of_turn = "" if self.tagged else self._end_of_turn()

  @classmethod
  def for_tokenizer(cls, tokenizer_path: str, chat_template_path: str = "") -> "ChatFormat":
    """The template of `chat_template_path` (a jinja file), else of the tokenizer's folder;
    DataError naming `chat_template_path` when there is none."""
    path = os.path.abspath(os.path.expanduser(tokenizer_path))
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    if chat_template_path:
      path = os.path.expanduser(chat_template_path)
      try:
        with open(path, encoding="utf-8") as f:
          template = f.read()
      except OSError as e:
        raise DataError(f"chat_template_path '{chat_template_path}' cannot be read: {e}") from e
    else:
      try:
        template = chat_template.find_template(folder)
      except DataError as e:
        raise DataError(f"sft=true: {e}; set chat_template_path=FILE (a jinja chat template)") \
            from e
    return cls(template, chat_template.special_tokens(folder))

  def render(self, messages: list[dict], add_generation_prompt: bool = False,
             marks: tuple[str, str] = ("", ""), options: dict | None = None) -> str:
    """`options`: the record's {"tools", "chat_template_kwargs"} (`options_of`)."""
    options = options or {}
    return chat_template.render(self.template, messages, self.tokens,
                                add_generation_prompt=add_generation_prompt,
                                generation_marks=marks, tools=options.get("tools"),
                                template_kwargs=options.get("chat_template_kwargs"))

  def _end_of_turn(self) -> str:
    """What the template writes right after an assistant message's content (trailing white space
    left out), from a probe conversation."""
    text = self.render([{"role": "user", "content": _PROBE[0]},
                        {"role": "assistant", "content": _PROBE[1]}])
    at = text.find(_PROBE[1])
    return text[at + 1:].rstrip() if at >= 0 else ""

  def render_with_spans(self, messages: list[dict], options: dict | None = None
                        ) -> tuple[str, list[tuple[int, int]]]:
    """(the conversation's text, [(start, end)] character spans of the assistant's text)."""
    for m in messages:
      if any(c in str(m.get("content", "")) for c in (*_MARKS, *_PROBE)):
        raise DataError("a message holds a private-use character U+E000..U+E003")
    if self.tagged:
      return _cut_marks(self.render(messages, marks=_MARKS, options=options))
    text = self.render(messages, options=options)
    spans, pos = [], 0
    for i, m in enumerate(messages):
      if m["role"] != "assistant":
        continue
      prefix = self.render(messages[:i], add_generation_prompt=True, options=options)
      if not text.startswith(prefix):
        raise DataError(f"the chat template's rendering of the {i} messages before assistant "
                        f"message {i} is not a prefix of the conversation's; give the template "
                        "{% generation %} blocks (chat_template_path)")
      start = max(len(prefix), pos)
      content = str(m.get("content") or "").strip()
      at = text.find(content, start)
      if at < 0:
        raise DataError(f"assistant message {i}'s content is not in the template's rendering; "
                        "give the template {% generation %} blocks (chat_template_path)")
      end = at + len(content)
      if self.end_of_turn and text.startswith(self.end_of_turn, end):
        end += len(self.end_of_turn)
      spans.append((start, end))
      pos = end
    return text, spans


def _cut_marks(text: str) -> tuple[str, list[tuple[int, int]]]:
  out, spans, start = [], [], None
  n = 0
  for c in text:
    if c == _MARKS[0]:
      start = n
    elif c == _MARKS[1]:
      if start is not None and n > start:
        spans.append((start, n))
      start = None
    else:
      out.append(c)
      n += 1
  return "".join(out), spans


def messages_of(record: Any) -> list[dict]:
  """The conversation of a record (DataError: no `messages` / `prompt`+`completion`, or a message
  that is not {"role": one of ROLES, "content": ...})."""
  if not isinstance(record, dict):
    raise DataError(f"a chat record must be a JSON object, got {type(record).__name__}")
  if "messages" in record:
    messages = record["messages"]
  elif "prompt" in record and "completion" in record:
    prompt, completion = record["prompt"], record["completion"]
    as_list = lambda x, role: [{"role": role, "content": x}] if isinstance(x, str) else x
    messages = as_list(prompt, "user")
    messages = (messages + as_list(completion, "assistant")) if isinstance(messages, list) \
        else None
  else:
    raise DataError(f"a chat record needs `messages` (or `prompt` and `completion`); it has "
                    f"{sorted(map(str, record))}")
  if not isinstance(messages, list) or not messages:
    raise DataError("`messages` must be a non-empty list of {role, content} objects")
  for i, m in enumerate(messages):
    if not isinstance(m, dict) or m.get("role") not in ROLES:
      role = m.get("role") if isinstance(m, dict) else m
      raise DataError(f"message {i} has role {role!r}; the roles are {', '.join(ROLES)}")
    content = m.get("content", "")
    if isinstance(content, list) and m["role"] != "assistant":
      kinds = [p.get("type") if isinstance(p, dict) else None for p in content]
      if not all(k in PART_TYPES for k in kinds):
        raise DataError(f"message {i}'s content parts have types {kinds}; the types are "
                        f"{', '.join(PART_TYPES)}")
    elif not isinstance(content, (str, type(None))):
      raise DataError(f"message {i}'s content is not a string" + (
          "" if m["role"] != "assistant" or not isinstance(content, list) else
          " (content parts: user and system messages only)"))
  if not any(m["role"] == "assistant" for m in messages):
    raise DataError("the conversation has no assistant message")
  return messages


def options_of(record: dict) -> dict:
  """The record's template options: {"tools": [...], "chat_template_kwargs": {...}} as given
  (DataError when they are not a list of objects / an object)."""
  tools, kwargs = record.get("tools"), record.get("chat_template_kwargs")
  if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict)
                                                                for t in tools)):
    raise DataError("`tools` must be a list of JSON-schema objects")
  if kwargs is not None and not isinstance(kwargs, dict):
    raise DataError("`chat_template_kwargs` must be an object")
  return {"tools": tools, "chat_template_kwargs": kwargs}


def assistant_token_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]],
                         length: int) -> np.ndarray:
  """Per token: 1 when any of its characters [a, b) lies in a span."""
  chars = np.zeros(length + 1, np.int64)
  for s, e in spans:
    chars[s:e] = 1
  cum = np.concatenate([[0], np.cumsum(chars)])
  a = np.asarray([o[0] for o in offsets], np.int64).clip(0, length)
  b = np.asarray([o[1] for o in offsets], np.int64).clip(0, length)
  return ((cum[b] - cum[a]) > 0).astype(np.int32)


def tokenize_chat(fmt: ChatFormat, tokenizer, messages: list[dict], options: dict | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
  """(token ids, assistant mask) of a conversation, int32 (`options`: `options_of`)."""
  text, spans = fmt.render_with_spans(messages, options)
  enc = tokenizer.impl.encode(text, add_special_tokens=False)
  return (np.asarray(enc.ids, np.int32),
          assistant_token_mask(enc.offsets, spans, len(text)))


# ---- the pipeline stages -------------------------------------------------------------------------
class Overlong:
  """Marker of a conversation dropped for its length (or for no target left in the loss)."""

  def __init__(self, where: str, why: str):
    self.where, self.why = where, why


class ChatToPairs:
  """A `{"record", "where"}` document (or a BadRecord) → `{"inputs", "targets", "loss_mask",
  "truncated"}` pairs, a BadRecord or an Overlong. Picklable (runs in Grain's threads/workers)."""

  def __init__(self, fmt: ChatFormat, tokenizer, seq_len: int, completion_only: bool,
               overlong: str, processor: Processor | None = None,
               slots: media_rows.MediaSlots | None = None):
    self.fmt, self.tokenizer, self.seq_len = fmt, tokenizer, seq_len
    self.completion_only, self.overlong = completion_only, overlong
    self.processor, self.slots = processor, slots   # media rows (media_rows.py), or None

  def __call__(self, doc: Any):
    if isinstance(doc, BadRecord):
      return doc
    record, where = doc
    media = None
    try:
      messages = messages_of(record)
      ids, mask = tokenize_chat(self.fmt, self.tokenizer, messages, options_of(record))
      if self.slots is not None:
        assert self.processor is not None   # (slots_for gives slots only with a processor)
        ids, mask, media = media_rows.expand(self.processor, self.slots, messages, ids, mask,
                                             where)
      elif any(media_of_messages(messages)):
        raise DataError("the conversation holds image / audio parts: set "
                        "max_num_images_per_example / max_num_audio_per_example")
    except (DataError, MediaError) as e:   # MediaError: an image / clip that cannot be read
      return BadRecord(where=where, why=str(e))
    if ids.shape[0] < 2:
      return Overlong(where, "fewer than 2 tokens")
    loss = mask[1:] if self.completion_only else np.ones(ids.shape[0] - 1, np.int32)
    truncated = ids.shape[0] - 1 > self.seq_len
    if truncated and (self.overlong == "drop" or media is not None):
      return Overlong(where, f"{ids.shape[0] - 1} pairs > max_target_length={self.seq_len}" + (
          " (a row with media is never cut)" if media is not None else ""))
    inputs, targets, loss = ids[:-1][:self.seq_len], ids[1:][:self.seq_len], loss[:self.seq_len]
    if not loss.any():
      return Overlong(where, "no assistant token within max_target_length")
    return {"inputs": inputs, "targets": targets, "loss_mask": loss.astype(np.int32),
            "truncated": np.int32(truncated), **(media or {})}


class _CountIterator(grain.DatasetIterator):
  """Counts truncated and dropped conversations (logged at 1, 2, 4, ...; kept in the state)."""

  def __init__(self, parent: grain.DatasetIterator):
    super().__init__(parent)
    self.truncated = self.dropped = 0

  @staticmethod
  def _log(n: int, message: str) -> None:
    if n & (n - 1) == 0:   # 1, 2, 4, 8, ...
      print(f"sft: {message}", file=sys.stderr, flush=True)

  def __next__(self) -> Any:
    while True:
      value = next(self._parent)
      if isinstance(value, Overlong):
        self.dropped += 1
        self._log(self.dropped, f"dropped {self.dropped} conversation(s) so far (latest "
                                f"{value.where}: {value.why})")
        continue
      if value.pop("truncated"):
        self.truncated += 1
        self._log(self.truncated, f"truncated {self.truncated} conversation(s) longer than "
                                  f"max_target_length={value['inputs'].shape[0]} pairs so far")
      return value

  def get_state(self) -> dict:
    return {"parent": self._parent.get_state(), "truncated": self.truncated,
            "dropped": self.dropped}

  def set_state(self, state: dict) -> None:
    self._parent.set_state(state["parent"])
    self.truncated, self.dropped = int(state["truncated"]), int(state["dropped"])


class CountOverlong(grain.IterDataset):
  def __iter__(self) -> _CountIterator:
    return _CountIterator(self._parent.__iter__())


class _Rows:
  """Grain's packed features (or one padded conversation) → the MaxText row keys; padding
  → pad_id; targets_segmentation = segment id × loss mask."""

  def __init__(self, pad_id: int, seq_len: int, packed: bool):
    self.pad_id, self.seq_len, self.packed = pad_id, seq_len, packed

  def __call__(self, row: dict) -> dict:
    if self.packed:
      seg, pos = row["inputs_segment_ids"], row["inputs_positions"]
      inputs, targets, loss = row["inputs"], row["targets"], row["loss_mask"]
    else:
      n, pad = row["inputs"].shape[0], self.seq_len - row["inputs"].shape[0]
      seg = np.pad(np.ones(n, np.int32), (0, pad))
      pos = np.pad(np.arange(n, dtype=np.int32), (0, pad))
      inputs, targets, loss = (np.pad(row[k], (0, pad)) for k in ("inputs", "targets", "loss_mask"))
    padding = seg == 0
    media = {k: row[k] for k in row if k in MEDIA_KEYS}
    return {**media, "inputs": np.where(padding, self.pad_id, inputs).astype(np.int32),
            "targets": np.where(padding, self.pad_id, targets).astype(np.int32),
            "inputs_segmentation": seg.astype(np.int32),
            "inputs_position": np.where(padding, 0, pos).astype(np.int32),
            "targets_segmentation": (seg * (loss != 0)).astype(np.int32)}


def rows(pairs: grain.IterDataset, seq_len: int, packing: bool, pad_id: int,
         num_packing_bins: int = 8) -> grain.IterDataset:
  """Conversation pairs (after the bad-record stage) → rows of `seq_len` (module docstring)."""
  pairs = CountOverlong(pairs)
  if packing:
    pairs = grain.experimental.FirstFitPackIterDataset(
        pairs, length_struct={k: seq_len for k in ("inputs", "targets", "loss_mask")},
        num_packing_bins=num_packing_bins, shuffle_bins=False)
  return pairs.map(_Rows(pad_id, seq_len, packing))


class ChatRecords:
  """Random-access source of (JSON record, where) over jsonl readers (file_readers.JsonlFileReader),
  in file order."""

  def __init__(self, readers: list):
    self.readers = readers
    self.starts = np.cumsum([0] + [len(r) for r in readers])

  def __len__(self) -> int:
    return int(self.starts[-1])

  def __getitem__(self, index: int):
    which = int(np.searchsorted(self.starts, index, side="right")) - 1
    return self.readers[which].record(index - int(self.starts[which]))


def record_files(dataset_path: str, dataset_format: str) -> list[str]:
  """The jsonl files of `dataset_path` (DataError for another format)."""
  files = sources.resolve_dataset_files(dataset_path, dataset_format)
  other = sorted({fmt for _, fmt in files} - {"jsonl"})
  if other:
    raise DataError(f"sft=true reads jsonl chat records; dataset_path '{dataset_path}' holds "
                    f"{other} files (dataset_format={dataset_format!r})")
  return [f for f, _ in files]


def record_dataset(dataset_path: str, dataset_format: str, *, eval_split_fraction: float,
                   split: str) -> grain.MapDataset:
  """A MapDataset of (record, where) per jsonl line (unreadable: a BadRecord), minus / only the
  held-out share (`sources.split_source`)."""
  readers = [file_readers.JsonlFileReader(f, "") for f in record_files(dataset_path,
                                                                       dataset_format)]
  source = ChatRecords(readers)
  if len(source) == 0:  # pylint: disable=g-explicit-length-test
    raise DataError(f"dataset_path '{dataset_path}' holds no chat records")
  source = sources.split_source(source, eval_split_fraction, split)
  return grain.MapDataset.source(bad_records.TolerantSource(source))
