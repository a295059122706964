"""Random-access document readers for one dataset file each (text, jsonl, parquet, ArrayRecord).

Each reader has ``__len__`` (number of documents) and ``__getitem__(i) -> str``, so
a list of them can back a Grain ``MapDataset`` with exact shuffling and resume.
Readers open files lazily and drop open handles when pickled (for Grain workers).
"""

from __future__ import annotations

import abc
import contextlib
import json
import threading
from typing import Any

import numpy as np

from MaxText.data.errors import DataError, RecordError
from MaxText.storage import paths

# File extension -> format, for dataset_format="auto".
EXTENSION_FORMATS = {
    ".txt": "text", ".md": "text", ".py": "text",
    ".jsonl": "jsonl", ".json": "jsonl",
    ".parquet": "parquet",
    ".array_record": "arrayrecord", ".arrayrecord": "arrayrecord",
}


def format_for_extension(path: str) -> str | None:
  """The format "auto" picks for `path`, or None for an unknown extension."""
  lower = path.lower()
  for ext, fmt in EXTENSION_FORMATS.items():
    if lower.endswith(ext):
      return fmt
  return None


class _Reader(abc.ABC):
  """Common lazy-handle / pickling behaviour."""

  def __init__(self, path: str):
    self.path = path
    self._lock = threading.Lock()  # Grain reads with several threads.

  def __getstate__(self):
    state = {k: v for k, v in self.__dict__.items() if not k.startswith("_h_")}
    state.pop("_lock")
    return state

  def __setstate__(self, state):
    vars(self).update(state)
    self._lock = threading.Lock()

  def __repr__(self) -> str:
    return f"{type(self).__name__}({self.path!r}, {len(self)} docs)"

  @abc.abstractmethod
  def __len__(self) -> int:
    """The format's count of documents."""

  @abc.abstractmethod
  def __getitem__(self, index: int) -> str:
    """The document at `index`."""


class TextFileReader(_Reader):
  """The whole file is one document (decoded as UTF-8, bad bytes replaced)."""

  def __len__(self) -> int:
    return 1

  def __getitem__(self, index: int) -> str:
    if index != 0:
      raise IndexError(index)
    return paths.read_bytes(self.path).decode("utf-8", errors="replace")


class JsonlFileReader(_Reader):
  """One JSON object per non-blank line; the document is its `text_field`.

  The constructor scans the file once to record where each line starts.
  """

  def __init__(self, path: str, text_field: str):
    super().__init__(path)
    self.text_field = text_field
    offsets, line_numbers = [], []
    pos = 0
    with paths.open_file(path, "rb") as f:
      for line_number, line in enumerate(f, 1):
        if line.strip():
          offsets.append(pos)
          line_numbers.append(line_number)
        pos += len(line)
    self.offsets = np.asarray(offsets, dtype=np.int64)
    self.line_numbers = np.asarray(line_numbers, dtype=np.int64)

  def __len__(self) -> int:
    return len(self.offsets)

  def record(self, index: int) -> tuple[Any, str]:
    """(the parsed JSON value of document `index`, where it is: "<path> line <n>")."""
    with self._lock:
      handle = self.__dict__.get("_h_file")
      if handle is None:
        handle = self._h_file = paths.open_file(self.path, "rb")  # pylint: disable=consider-using-with
      handle.seek(int(self.offsets[index]))
      line = handle.readline()
    where = f"{self.path} line {int(self.line_numbers[index])}"
    try:
      return json.loads(line), where
    except ValueError as e:
      raise RecordError(f"dataset_path: {where} is not valid JSON: {e}") from e

  def __getitem__(self, index: int) -> str:
    return text_from_record(*self.record(index), self.text_field)


def text_from_record(record: Any, where: str, text_field: str) -> str:
  """The document of a JSON record: its `text_field` (RecordError naming `where`: no such field,
  not a string; a chat record gets the hint that `sft=true` reads it)."""
  if not isinstance(record, dict) or text_field not in record:
    raise RecordError(f"dataset_text_field '{text_field}' is missing in {where}"
                      + (chat_hint(record) if isinstance(record, dict) else ""))
  value = record[text_field]
  if not isinstance(value, str):
    raise RecordError(f"dataset_text_field '{text_field}' is not a string in {where}")
  return value


def chat_hint(fields) -> str:
  """"" or, for a record (its keys) / a table (its columns) in the chat format sft=true reads
  (`messages`, or `prompt` and `completion`: MaxText/data/sft.py), the hint that says so."""
  if "messages" in fields:
    held = "`messages`"
  elif "prompt" in fields and "completion" in fields:
    held = "`prompt` and `completion`"
  else:
    return ""
  return (f"; it holds {held}, the chat format: chat data is read with sft=true, as "
          "configs/sft.yml sets it (python train.py configs/sft.yml dataset_path=...)")


class ParquetFileReader(_Reader):
  """One row per document, column `text_field`; caches the last row group read.

  Random access costs one row-group read per cache miss, so prefer files with
  modest row groups when shuffling.
  """

  def __init__(self, path: str, text_field: str):
    super().__init__(path)
    self.text_field = text_field
    try:
      with _parquet(path) as f:
        meta = f.metadata
    except (OSError, ValueError) as e:  # not Parquet, truncated footer, unreadable: ArrowInvalid
      raise DataError(f"dataset_path: {path} is not a readable Parquet file: {e}") from e
    names = [meta.schema.column(i).name for i in range(meta.num_columns)]
    if text_field not in names:
      raise DataError(f"dataset_text_field '{text_field}' is not a column of {path} "
                      f"(columns: {names}){chat_hint(names)}")
    sizes = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
    self.group_starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])

  def __len__(self) -> int:
    return int(self.group_starts[-1])

  def __getitem__(self, index: int) -> str:
    if not 0 <= index < len(self):
      raise IndexError(index)
    group = int(np.searchsorted(self.group_starts, index, side="right")) - 1
    with self._lock:
      cached = self.__dict__.get("_h_group")
      if cached is None or cached[0] != group:
        try:
          with _parquet(self.path) as f:
            table = f.read_row_group(group, columns=[self.text_field])
        except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
          raise RecordError(f"dataset_path: {self.path} row group {group} cannot be read: "
                          f"{e}") from e
        cached = self._h_group = (group, table.column(0).to_pylist())
    value = cached[1][index - int(self.group_starts[group])]
    if not isinstance(value, str):
      raise RecordError(f"dataset_text_field '{self.text_field}' is not a string in "
                      f"{self.path} row {index}")
    return value


@contextlib.contextmanager
def _parquet(path: str):
  """pyarrow's ParquetFile of a local path (its own file reads), or of an object on a store
  through fsspec's file (ranged reads: the footer, then the row group's columns)."""
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  if not paths.is_url(path):
    with pq.ParquetFile(path) as f:
      yield f
    return
  with paths.open_file(path, "rb") as raw, pq.ParquetFile(raw) as f:
    yield f


class ArrayRecordFileReader(_Reader):
  """One record per document: UTF-8 text, or a JSON object holding `text_field`."""

  def __init__(self, path: str, text_field: str):
    super().__init__(path)
    self.text_field = text_field
    try:
      self._length = len(self._source())
    except (OSError, RuntimeError, ValueError) as e:   # not ArrayRecord, truncated
      raise DataError(f"dataset_path: {path} is not a readable ArrayRecord file: {e}") from e

  def _source(self):
    source = self.__dict__.get("_h_source")
    if source is None:
      from array_record.python import array_record_data_source as ards
      source = self._h_source = ards.ArrayRecordDataSource([self.path])
    return source

  def __len__(self) -> int:
    return self._length

  def __getitem__(self, index: int) -> str:
    with self._lock:
      source = self._source()
    try:
      raw = source[index]
    except (OSError, RuntimeError, ValueError) as e:
      raise RecordError(f"dataset_path: {self.path} record {index} cannot be read: {e}") from e
    text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else str(raw)
    if text.lstrip().startswith("{"):
      try:
        record = json.loads(text)
      except ValueError:
        return text  # Plain text that happens to start with "{".
      return text_from_record(record, f"{self.path} record {index}", self.text_field)
    return text


# dataset_format → its reader: the schema's choices of `dataset_format` but "auto" (a test checks).
READERS = {
    "text": lambda path, text_field: TextFileReader(path),
    "jsonl": JsonlFileReader,
    "parquet": ParquetFileReader,
    "arrayrecord": ArrayRecordFileReader,
}


def make_reader(path: str, fmt: str, text_field: str) -> _Reader:
  """Opens `path` as format `fmt` (a key of READERS)."""
  if fmt not in READERS:
    raise DataError(f"dataset_format '{fmt}' is not one of {['auto', *READERS]}")
  if fmt == "arrayrecord" and paths.is_url(path):
    raise DataError(f"dataset_path: {path}: ArrayRecord files are read from local paths only "
                    "(text, jsonl and parquet also from an object store)")
  return READERS[fmt](path, text_field)
