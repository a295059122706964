"""Held-out batches for evaluation: the documents training never reads — the `eval_split_fraction`
share of the training source (`sources.held_out`, for the embedded default too) or the files of
`eval_dataset_path` (read with the training's format keys) — packed like training rows, in order,
one pass, in the training batch layout (the same data shards, each process reading its own).

An evaluation reads `eval_steps` global batches from the start of that stream each time, so every
evaluation of a run sees the same tokens. Once a shard's documents run out its rows are padding
(segment 0: no loss, no token counted), so every process feeds the same number of batches.
"""
from __future__ import annotations

import dataclasses
from typing import Iterator, Sequence

import numpy as np

from MaxText.data import sources
from MaxText.data.config import DataConfig
from MaxText.data.errors import DataError
from MaxText.data.batch import BATCH_KEYS
from MaxText.data.pipeline import media_slots, row_dataset
from MaxText.data.tokenizers import Tokenizer


def eval_source(dcfg: DataConfig, eval_dataset_path: str, *, whole_dataset: bool = False
                ) -> tuple[DataConfig, str]:
  """(the data config the held-out documents are read with, the split of its source).
  `whole_dataset`: with neither eval key set, every document of the dataset keys (evaluating a
  checkpoint on a dataset)."""
  if whole_dataset and not eval_dataset_path and dcfg.eval_split_fraction <= 0:
    return dcfg, "all"
  problems = eval_problems(dcfg, eval_dataset_path)
  if problems:
    raise DataError(problems[0][1])
  if eval_dataset_path:
    return dataclasses.replace(dcfg, dataset_type="file", dataset_path=eval_dataset_path,
                               eval_split_fraction=0.0), "all"
  return dcfg, "eval"


def eval_problems(dcfg: DataConfig, eval_dataset_path: str) -> list[tuple[str, str]]:
  """Why there is no held-out data to evaluate on: [(key, problem)] (files are only stat-ed)."""
  if eval_dataset_path and dcfg.eval_split_fraction > 0:
    return [("eval_dataset_path", f"eval_dataset_path={eval_dataset_path!r} and "
                                  f"eval_split_fraction={dcfg.eval_split_fraction} both set: give "
                                  "one source of held-out data")]
  if eval_dataset_path:
    try:
      sources.resolve_dataset_files(eval_dataset_path, dcfg.dataset_format)
    except DataError as e:
      return [("eval_dataset_path", f"eval_dataset_path: {e}")]
    return []
  if dcfg.eval_split_fraction <= 0:
    return [("eval_split_fraction", "evaluation needs held-out data: set eval_dataset_path or "
                                    "eval_split_fraction > 0")]
  if dcfg.dataset_type == "synthetic":
    return [("eval_split_fraction", "dataset_type=synthetic has no documents to hold out; set "
                                    "eval_dataset_path")]
  return []


def padding_row(seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
  row = {k: np.zeros(seq_len, np.int32) for k in BATCH_KEYS}
  row["inputs"][:] = pad_id
  row["targets"][:] = pad_id
  return row


class EvalBatches:
  """`steps` host batches of held-out rows for this process's data shards (`shard_ids` of
  `num_shards`, `shard_batch` rows each), stacked in shard order like training batches."""

  def __init__(self, dcfg: DataConfig, split: str, tokenizer: Tokenizer | None,
               shard_ids: Sequence[int], num_shards: int, shard_batch: int, steps: int):
    """`dcfg`, `split`: what `eval_source` gives."""
    if dcfg.dataset_type == "synthetic":
      raise DataError("dataset_type=synthetic has no documents to evaluate on; set "
                      "eval_dataset_path")
    if tokenizer is None:   # (the run's tokenizer is None for synthetic training data only)
      raise DataError(f"evaluating on dataset_type={dcfg.dataset_type} needs the tokenizer "
                      f"(tokenizer_path '{dcfg.tokenizer_path}')")
    self.dcfg, self.split = dcfg, split
    self.tokenizer: Tokenizer = tokenizer
    self.shard_ids, self.num_shards = list(shard_ids), num_shards
    self.shard_batch, self.steps = shard_batch, steps

  def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
    rows = {s: iter(row_dataset(self.dcfg, self.tokenizer, s, self.num_shards, split=self.split,
                                endless=False)) for s in self.shard_ids}
    pad = padding_row(self.dcfg.max_target_length, self.tokenizer.pad_id)
    slots = media_slots(self.dcfg, self.tokenizer)   # SFT rows with images / audio
    pad.update(slots.empty() if slots is not None else {})
    for _ in range(self.steps):
      block = []
      for s in self.shard_ids:
        for _ in range(self.shard_batch):
          block.append(next(rows[s], pad))
      yield {k: np.stack([r[k] for r in block]).astype(v.dtype) for k, v in pad.items()}
