"""Synthetic data: deterministic random token rows, no text and no files.

Row ``i`` is drawn from ``numpy.random.default_rng([seed, i])``: S + 1 tokens in
``[3, vocab_size)`` (ids 0-2 are left to pad/bos/eos), split into next-token
``inputs``/``targets``. Every position is valid and the row is one segment.
The dataset is infinite and random access, so sharding and resume are exact.
"""

from __future__ import annotations

import sys

import grain
import numpy as np

from MaxText.data.errors import DataError

FIRST_TOKEN = 3


class SyntheticRow:
  """Global row index -> one training row (picklable, runs in Grain workers)."""

  def __init__(self, seed: int, seq_len: int, vocab_size: int):
    if vocab_size <= FIRST_TOKEN:
      raise DataError(f"vocab_size={vocab_size} must be > {FIRST_TOKEN} for synthetic data")
    self.seed = int(seed)
    self.seq_len = int(seq_len)
    self.vocab_size = int(vocab_size)

  def __call__(self, index: int) -> dict:
    rng = np.random.default_rng([self.seed, int(index)])
    tokens = rng.integers(FIRST_TOKEN, self.vocab_size, size=self.seq_len + 1, dtype=np.int32)
    ones = np.ones(self.seq_len, np.int32)
    return {
        "inputs": tokens[:-1],
        "targets": tokens[1:],
        "inputs_segmentation": ones,
        "inputs_position": np.arange(self.seq_len, dtype=np.int32),
        "targets_segmentation": ones.copy(),
    }


def synthetic_rows(seed: int, seq_len: int, vocab_size: int, process_index: int,
                   process_count: int) -> grain.MapDataset:
  """This process's rows (global rows ``process_index::process_count``), endless."""
  rows = grain.MapDataset.range(sys.maxsize)[process_index::process_count]
  return rows.map(SyntheticRow(seed, seq_len, vocab_size))
