"""Tokenize documents and pack them into fixed-length training rows.

Row format: the batch contract of ``MaxText/data/batch.py`` (``BATCH_KEYS``, int32 of length
S = max_target_length each).

How it works: a tokenized document ``t0 .. tn`` (bos/eos included) becomes n
(input, target) *pairs* ``(t0,t1), (t1,t2), ..., (tn-1,tn)``; rows are filled with
pairs, never with raw tokens. So a target can never come from another document
(no cross-document prediction; ``targets_segmentation == inputs_segmentation``),
and no pair is lost at row or document boundaries. The last token of a document
only appears as a target, exactly as in the unpacked case. Documents with fewer than
2 tokens give no pairs and are dropped.

Packing (``packing=True``) uses Grain's ``ConcatThenSplitIterDataset``: pairs of
consecutive documents are concatenated and cut every S pairs, so rows have no
padding except at the very end of a finite stream. A document longer than the
room left in a row is split: its continuation starts the next row as a new
segment whose positions restart at 0 (it sees no earlier context of its document).

Without packing each row holds one piece of at most S pairs of one document,
padded with ``pad_id`` tokens, segment 0 and position 0; long documents are split
into consecutive pieces, each restarting positions at 0.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import grain
import numpy as np

from MaxText.data.bad_records import BadRecord
from MaxText.data.batch import BATCH_KEYS
from MaxText.data.errors import DataError



class TokenizeToPairs:
  """Maps a document string to ``{"inputs", "targets"}`` pair arrays, or None if too short.

  A picklable callable (it runs inside Grain worker processes).
  """

  def __init__(self, tokenizer, add_bos: bool, add_eos: bool):
    if add_bos and tokenizer.bos_id is None:
      raise DataError(f"add_bos is true but the tokenizer {tokenizer!r} has no bos token")
    if add_eos and tokenizer.eos_id is None:
      raise DataError(f"add_eos is true but the tokenizer {tokenizer!r} has no eos token")
    self.tokenizer = tokenizer
    self.add_bos = bool(add_bos)
    self.add_eos = bool(add_eos)

  def tokenize(self, text: str) -> np.ndarray:
    """Token ids of `text` with the configured bos/eos, as int32."""
    ids = list(self.tokenizer.encode(text))
    if self.add_bos:
      ids.insert(0, self.tokenizer.bos_id)
    if self.add_eos:
      ids.append(self.tokenizer.eos_id)
    return np.asarray(ids, dtype=np.int32)

  def __call__(self, text: str) -> Optional[dict] | BadRecord:
    if isinstance(text, BadRecord):
      return text  # counted and dropped by bad_records.SkipBadRecords
    return tokens_to_pairs(self.tokenize(text))


def tokens_to_pairs(tokens: Sequence[int] | np.ndarray) -> Optional[dict]:
  """``{"inputs": tokens[:-1], "targets": tokens[1:]}`` as int32, or None if < 2 tokens."""
  ids = np.asarray(tokens, dtype=np.int32)
  if ids.shape[0] < 2:
    return None
  return {"inputs": ids[:-1], "targets": ids[1:]}


class _RenamePacked:
  """Grain's ``<feature>_segment_ids``/``_positions`` -> MaxText keys; padding -> pad_id."""

  def __init__(self, pad_id: int):
    self.pad_id = pad_id

  def __call__(self, row: dict) -> dict:
    padding = row["inputs_segment_ids"] == 0
    return {
        "inputs": np.where(padding, self.pad_id, row["inputs"]).astype(np.int32),
        "targets": np.where(padding, self.pad_id, row["targets"]).astype(np.int32),
        "inputs_segmentation": row["inputs_segment_ids"],
        "inputs_position": row["inputs_positions"],
        "targets_segmentation": row["targets_segment_ids"],
    }


def pack_pairs(pairs: grain.IterDataset, seq_len: int, pad_id: int = 0) -> grain.IterDataset:
  """Concatenate-then-split packing of pair dicts into rows of `seq_len` (see module doc)."""
  packed = grain.experimental.ConcatThenSplitIterDataset(
      pairs, length_struct={"inputs": seq_len, "targets": seq_len})
  return packed.map(_RenamePacked(pad_id))


class _ChunkPairs(grain.experimental.FlatMapTransform):
  """One document's pairs -> padded rows of at most `seq_len` pairs each."""

  max_fan_out = 1 << 30  # Only used by MapDataset flat maps; we flat-map an IterDataset.

  def __init__(self, seq_len: int, pad_id: int):
    self.seq_len = seq_len
    self.pad_id = pad_id

  def flat_map(self, element: dict) -> list[dict]:
    inputs, targets = element["inputs"], element["targets"]
    rows = []
    for start in range(0, inputs.shape[0], self.seq_len):
      n = min(self.seq_len, inputs.shape[0] - start)
      row = {k: np.zeros(self.seq_len, np.int32) for k in BATCH_KEYS}
      row["inputs"][:] = self.pad_id
      row["targets"][:] = self.pad_id
      row["inputs"][:n] = inputs[start:start + n]
      row["targets"][:n] = targets[start:start + n]
      row["inputs_segmentation"][:n] = 1
      row["targets_segmentation"][:n] = 1
      row["inputs_position"][:n] = np.arange(n, dtype=np.int32)
      rows.append(row)
    return rows


def chunk_pairs(pairs: grain.IterDataset, seq_len: int, pad_id: int = 0) -> grain.IterDataset:
  """No packing: each row is one piece of one document, padded to `seq_len`."""
  return grain.experimental.FlatMapIterDataset(pairs, _ChunkPairs(seq_len, pad_id))


def rows_from_pairs(pairs: grain.IterDataset, seq_len: int, packing: bool,
                    pad_id: int = 0) -> grain.IterDataset:
  """Packed or one-document-per-row rows, per the `packing` config key."""
  if seq_len < 1:
    raise DataError(f"max_target_length must be >= 1, got {seq_len}")
  if packing:
    return pack_pairs(pairs, seq_len, pad_id)
  return chunk_pairs(pairs, seq_len, pad_id)


def rows_from_token_lists(docs: Iterable[Sequence[int]], seq_len: int, packing: bool = True,
                          pad_id: int = 0) -> list[dict]:
  """Rows for already-tokenized documents, in order (finite; for tests and inspection)."""
  pairs = [p for p in (tokens_to_pairs(d) for d in docs) if p is not None]
  ds = grain.MapDataset.source(pairs).to_iter_dataset()
  return list(rows_from_pairs(ds, seq_len, packing, pad_id))
