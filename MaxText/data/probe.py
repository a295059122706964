"""The first records of a dataset, read and checked before anything compiles.

Training reads its records lazily, after the train step has compiled; a dataset of the wrong
format (chat records given to the plain-text pipeline, a `dataset_text_field` no record has,
a file that is not JSON lines) would otherwise be found only then. `check_first_records` reads the
first `PROBE_RECORDS` records of the first file (in sorted order: the file training's documents
begin with) as training reads them, and raises BadRecordsError (exit 3) when more than
`max_bad_records` of them are bad — naming the first, at its file and line. The rest of the data
is checked as training reads it (bad_records.py). Cheap on any dataset: a few records of one file
(a Parquet file: its footer's columns only; a text file: nothing, it has no records to be bad).
"""
from __future__ import annotations

import json
from typing import Any, Callable, Iterator

from MaxText.data import file_readers
from MaxText.data.errors import BadRecordsError, DataError, RecordError
from MaxText.storage import paths

PROBE_RECORDS = 16


def _jsonl_lines(path: str, limit: int) -> Iterator[tuple[Any, str]]:
  """(parsed record, "<path> line <n>") of the first `limit` non-blank lines; RecordError for a
  line that is not JSON, raised when that line is reached."""
  try:
    f = paths.open_file(path, "rb")
  except OSError as e:
    raise BadRecordsError(f"dataset_path: {path} cannot be read: {e}") from None
  with f:
    seen = 0
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      where = f"{path} line {number}"
      try:
        yield json.loads(line), where
      except ValueError as e:
        yield RecordError(f"dataset_path: {where} is not valid JSON: {e}"), where
      seen += 1
      if seen >= limit:
        return


def _check(items: Iterator[Any], check: Callable[[Any], Any], max_bad: int, path: str,
           what: str) -> None:
  bad: list[str] = []
  read = 0
  for item in items:
    read += 1
    try:
      check(item)
    except DataError as e:
      bad.append(str(e))
      if len(bad) > max_bad:
        raise BadRecordsError(
            f"more than max_bad_records={max_bad} bad records in {path}, found before compiling "
            f"({len(bad)} of its first {read} {what}); the first, {bad[0]}") from None


def check_first_records(files: list[tuple[str, str]], text_field: str, max_bad: int) -> None:
  """The plain-text pipeline's check of `files` ([(file, format)], sorted): the first records of
  the first file that has records (text files have none)."""
  for path, fmt in files:
    if fmt == "text":
      continue
    if fmt == "jsonl":
      def text(item):
        record, where = item
        if isinstance(record, Exception):
          raise record
        return file_readers.text_from_record(record, where, text_field)
      _check(_jsonl_lines(path, PROBE_RECORDS), text, max_bad, path, "lines")
      return
    try:   # a file that is no file of its format (or lacks the text column): bad data, exit 3
      reader = file_readers.make_reader(path, fmt, text_field)   # Parquet: the footer only
    except BadRecordsError:
      raise
    except DataError as e:
      raise BadRecordsError(str(e)) from None
    if fmt != "parquet":   # a Parquet row group may be large: its rows are checked when read
      _check(iter(range(min(PROBE_RECORDS, len(reader)))), reader.__getitem__, max_bad, path,
             "records")
    return


def check_first_chat_records(files: list[str], check: Callable[[Any], Any], max_bad: int) -> None:
  """sft=true's check of the first lines of the first jsonl file: `check(record)` raises
  DataError for a record that is not a conversation (sft.messages_of)."""
  if not files:
    return

  def chat(item):
    record, where = item
    if isinstance(record, Exception):
      raise record
    try:
      check(record)
    except DataError as e:
      hint = ""
      if isinstance(record, dict) and "text" in record and not file_readers.chat_hint(record):
        hint = ("; it holds `text`, a plain-text record: those are read with sft=false "
                "(configs/base.yml)")
      raise DataError(f"{where}: {e}{hint}") from None
  _check(_jsonl_lines(files[0], PROBE_RECORDS), chat, max_bad, files[0], "lines")
