"""Bounded, counted, deterministic skipping of corrupt or truncated records.

A document source wrapped in `TolerantSource` returns a `BadRecord` (where + why) instead of raising
when one record cannot be read (invalid JSON, missing or non-string text field, an unreadable
ArrayRecord entry). `SkipBadRecords`, a Grain stage after the document reads, drops them and counts
them; the count is part of the iterator state, so a resumed run skips the same records and keeps
counting where it was. More than `max_bad_records` raises BadRecordsError (exit status 3). The first records of the data
are checked before anything compiles (probe.py).
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Any

import grain

from MaxText.data.errors import BadRecordsError, DataError, RecordError


@dataclasses.dataclass(frozen=True)
class BadRecord:
  """Marker for a record that could not be read (travels through the map stages untouched).
  `where` is "" when `why` names the place itself (a reader's RecordError)."""
  where: str
  why: str

  def __str__(self) -> str:
    return f"{self.where}: {self.why}" if self.where else self.why


class TolerantSource:
  """Random-access source whose unreadable records become `BadRecord`s."""

  def __init__(self, source):
    self.source = source

  def __len__(self) -> int:
    return len(self.source)

  def __getitem__(self, index: int):
    try:
      return self.source[index]
    except RecordError as e:   # names its file and line (row, record) itself
      return BadRecord(where="", why=str(e))
    except DataError as e:
      return BadRecord(where=f"document {index}", why=str(e))

  def __repr__(self) -> str:
    return f"TolerantSource({self.source!r})"


class _SkipIterator(grain.DatasetIterator):

  def __init__(self, parent: grain.DatasetIterator, max_bad: int):
    super().__init__(parent)
    self._max_bad = max_bad
    self._bad = 0

  def __next__(self) -> Any:
    while True:
      value = next(self._parent)
      if not isinstance(value, BadRecord):
        return value
      self._bad += 1
      if self._bad > self._max_bad:
        raise BadRecordsError(f"more than max_bad_records={self._max_bad} bad records; the "
                              f"last, {value}")
      print(f"skipped bad record {self._bad}/{self._max_bad}: {value}", file=sys.stderr,
            flush=True)

  def get_state(self) -> dict:
    return {"parent": self._parent.get_state(), "bad_records": self._bad}

  def set_state(self, state: dict) -> None:
    self._parent.set_state(state["parent"])
    self._bad = int(state["bad_records"])


class SkipBadRecords(grain.IterDataset):
  """Drops `BadRecord`s, counting them; DataError once more than `max_bad` were seen."""

  def __init__(self, parent: grain.IterDataset, max_bad: int):
    super().__init__(parent)
    self._max_bad = int(max_bad)

  def __iter__(self) -> _SkipIterator:
    return _SkipIterator(self._parent.__iter__(), self._max_bad)
