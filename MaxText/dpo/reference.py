"""DPO's reference log-probabilities computed once instead of by a frozen copy held all along
(TRL's `precompute_ref_log_probs`).

`precompute_ref_log_probs=true`: before the first step, the reference's summed response
log-probabilities of every pair of `preferences` (and of `eval_preferences`) are computed in batches
of the step's pairs — at a fresh start the reference is the state's own parameters (with LoRA the
base under the adapters), so no copy is made at all — and written to
`<run dir>/reference_logps/{preferences,eval_preferences}.jsonl`; a resumed run reads them back
(or, when they are missing, loads the reference once to compute them). `reference_logps=DIR`: read
them from such a folder (another run's) and compute nothing. Either way the step's batch takes its
pairs' values from the table, and the memory pre-flight counts no reference copy.

A file: one JSON object a line per pair, in the pairs file's order:
{"line": the pair's line in its .jsonl, "chosen": float, "rejected": float}. A file that is
missing, unreadable or does not match the pairs (count, lines) is a DataError naming the key
(exit 3).
"""
from __future__ import annotations

import json
import os
from typing import Callable

import numpy as np

from MaxText.data.errors import DataError
from MaxText.dpo.data import PreferenceSet
from MaxText.storage import paths

FOLDER = "reference_logps"
SETS = ("preferences", "eval_preferences")


def file_of(folder: str, key: str) -> str:
  return paths.join(folder, f"{key}.jsonl")


def compute(pairs: PreferenceSet, per_batch: int, sums: Callable[[dict], dict]
            ) -> dict[str, np.ndarray]:
  """{"chosen": [P], "rejected": [P]} of every pair of `pairs`, `per_batch` pairs at a time
  through `sums(host batch) -> {"chosen": [per_batch], "rejected": [per_batch]}` (the last batch
  padded with its last pair)."""
  out = {"chosen": np.zeros(len(pairs), np.float32), "rejected": np.zeros(len(pairs), np.float32)}
  for first in range(0, len(pairs), per_batch):
    idx = list(range(first, min(first + per_batch, len(pairs))))
    got = sums(pairs.take(idx + [idx[-1]] * (per_batch - len(idx))))
    for side in out:
      out[side][first:first + len(idx)] = np.asarray(got[side])[:len(idx)]
  return out


def write(folder: str, key: str, pairs: PreferenceSet, table: dict[str, np.ndarray]) -> None:
  paths.makedirs(folder)
  lines = "".join(json.dumps({"line": n, "chosen": float(c), "rejected": float(r)}) + "\n"
                  for n, c, r in zip(pairs.lines, table["chosen"], table["rejected"]))
  paths.write_text(file_of(folder, key), lines)


def read(folder: str, key: str, pairs: PreferenceSet, config_key: str) -> dict[str, np.ndarray]:
  """The table of `pairs` (config key `key`) from `folder`; DataError naming `config_key`."""
  path = file_of(folder, key)
  where = f"{config_key}={folder}: {os.path.basename(path)}"
  if not paths.exists(path):
    raise DataError(f"{where}: no such file (a folder written by a run with "
                    "precompute_ref_log_probs=true: its run directory's reference_logps)")
  rows = []
  for n, line in enumerate(paths.read_text(path).splitlines(), 1):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
      rows.append((int(row["line"]), float(row["chosen"]), float(row["rejected"])))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
      raise DataError(f"{where} line {n}: expected {{\"line\", \"chosen\", \"rejected\"}} "
                      f"({type(e).__name__}: {e})") from None
  if [r[0] for r in rows] != list(pairs.lines):
    raise DataError(f"{where}: {len(rows)} rows for lines {[r[0] for r in rows][:5]}..., but "
                    f"{key}={pairs.path} has {len(pairs)} pairs on lines "
                    f"{list(pairs.lines)[:5]}...: computed for another file")
  table = {"chosen": np.array([r[1] for r in rows], np.float32),
           "rejected": np.array([r[2] for r in rows], np.float32)}
  if not all(np.isfinite(v).all() for v in table.values()):
    raise DataError(f"{where}: non-finite log-probabilities")
  return table
