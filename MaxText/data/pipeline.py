"""The training input pipeline: config -> resumable iterator of packed numpy batches.

Grain dataset graph (per process)::

    documents (MapDataset, random access)
      -> [process_index::process_count]   disjoint document shard per process
      -> shuffle(data_shuffle_seed)       a new permutation every epoch (if `shuffle`)
      -> repeat()                         endless epochs
      -> map(tokenize -> pairs)           runs on Grain's read threads
      -> to_iter_dataset
      -> skip bad records                 counted, at most `max_bad_records` (bad_records.py)
      -> pack (or chunk) into rows of max_target_length
      -> batch(per_process_batch_size, drop_remainder=True)
      -> mp_prefetch(grain_worker_count)  optional worker processes

``dataset_type="synthetic"`` replaces everything before ``batch`` with
deterministic random rows. Every stage is checkpointable, so
``DataIterator.get_state``/``set_state`` resume bit-exactly; the state carries a fingerprint of
the data config, and a state from another config is refused (DataError).
"""

from __future__ import annotations

import copy
from typing import Any

import grain
import numpy as np

from MaxText.data import bad_records
from MaxText.data import packing
from MaxText.data import sources
from MaxText.data import synthetic
from MaxText.data.errors import DataError
from MaxText.data.validation import DATA_CONFIG_KEYS, get_key, validate_data_config

# Data keys that may change between a save and its resume (everything else must match).
_RESUMABLE_KEYS = ("max_bad_records",)

# Read-ahead of the document stage; small because documents can be large.
_READ_OPTIONS = grain.ReadOptions(num_threads=4, prefetch_buffer_size=64)


class DataIterator:
  """Iterator of batches: dicts of int32 arrays ``[per_process_batch_size, max_target_length]``.

  Keys are ``packing.BATCH_KEYS``. ``get_state()`` returns a JSON-serialisable dict;
  after ``set_state(state)`` the next batch equals the one that followed ``state``.
  `fingerprint` (the data config and batch layout) travels with the state and must match.
  """

  def __init__(self, dataset: grain.IterDataset, tokenizer, fingerprint: dict | None = None):
    self.tokenizer = tokenizer
    self.fingerprint = fingerprint
    self._dataset = dataset
    self._iterator = iter(dataset)

  def __iter__(self) -> "DataIterator":
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    return next(self._iterator)

  def get_state(self) -> dict:
    """Grain's iterator state, encoded so ``json.dumps`` round-trips it exactly."""
    return {"grain": _encode_state(self._iterator.get_state()), "fingerprint": self.fingerprint}

  def set_state(self, state: dict) -> None:
    """Restores a state from ``get_state`` (possibly after a JSON round trip).

    Raises:
      DataError: the state is not one, or belongs to another data config or batch layout.
    """
    if not isinstance(state, dict) or "grain" not in state:
      raise DataError(f"data iterator state must come from DataIterator.get_state, got "
                      f"{type(state).__name__}")
    saved = state.get("fingerprint")
    if self.fingerprint is not None and saved != self.fingerprint:
      if not isinstance(saved, dict):
        raise DataError("data iterator state has no data config fingerprint (written by another "
                        "version); refusing to guess where the stream was")
      diff = [f"{k}: saved {saved.get(k)!r}, now {self.fingerprint.get(k)!r}"
              for k in sorted(set(saved) | set(self.fingerprint))
              if saved.get(k) != self.fingerprint.get(k)]
      raise DataError("data iterator state was saved for another data config (" + "; ".join(diff)
                      + "); resume with the same data keys, or start a new run_name")
    try:
      self._iterator.set_state(_decode_state(copy.deepcopy(state["grain"])))
    except (KeyError, IndexError, TypeError, ValueError) as e:
      raise DataError(f"data iterator state does not fit this pipeline: {type(e).__name__}: "
                      f"{e}") from e

  def close(self) -> None:
    """Stops Grain worker processes, if any."""
    close = getattr(self._iterator, "close", None)
    if close is not None:
      close()


_TUPLE_TAG = "__tuple__"


def _encode_state(value: Any) -> Any:
  """Makes Grain state JSON-safe: tuples are tagged so they come back as tuples."""
  if isinstance(value, dict):
    if not all(isinstance(k, str) for k in value):
      raise TypeError(f"Grain state has non-string keys: {list(value)}")
    return {k: _encode_state(v) for k, v in value.items()}
  if isinstance(value, tuple):
    return {_TUPLE_TAG: [_encode_state(v) for v in value]}
  if isinstance(value, list):
    return [_encode_state(v) for v in value]
  if isinstance(value, np.generic):
    return value.item()
  if value is None or isinstance(value, (bool, int, float, str)):
    return value
  raise TypeError(f"cannot serialise Grain state value {value!r}")


def _decode_state(value: Any) -> Any:
  if isinstance(value, dict):
    if set(value) == {_TUPLE_TAG}:
      return tuple(_decode_state(v) for v in value[_TUPLE_TAG])
    return {k: _decode_state(v) for k, v in value.items()}
  if isinstance(value, list):
    return [_decode_state(v) for v in value]
  return value


def _row_dataset(cfg: Any, tokenizer, process_index: int,
                 process_count: int) -> grain.IterDataset:
  """Unbatched rows for this process (see the module docstring for the graph)."""
  seq_len = get_key(cfg, "max_target_length")
  seed = get_key(cfg, "data_shuffle_seed")
  if get_key(cfg, "dataset_type") == "synthetic":
    rows = synthetic.synthetic_rows(seed, seq_len, get_key(cfg, "vocab_size"), process_index,
                                    process_count)
    return rows.to_iter_dataset(_READ_OPTIONS)

  docs = sources.document_dataset(
      get_key(cfg, "dataset_type"), get_key(cfg, "dataset_path"),
      get_key(cfg, "dataset_format"), get_key(cfg, "dataset_text_field"), tolerant=True)
  if len(docs) < process_count:
    raise DataError(f"dataset_path '{get_key(cfg, 'dataset_path')}' has {len(docs)} documents, "
                    f"fewer than the {process_count} processes that must each read some")
  docs = docs[process_index::process_count]
  if get_key(cfg, "shuffle"):
    docs = docs.shuffle(seed=seed)
  docs = docs.repeat()
  to_pairs = packing.TokenizeToPairs(tokenizer, get_key(cfg, "add_bos"), get_key(cfg, "add_eos"))
  pairs = docs.map(to_pairs).to_iter_dataset(_READ_OPTIONS)  # Drops None (too-short docs).
  pairs = bad_records.SkipBadRecords(pairs, get_key(cfg, "max_bad_records"))
  return packing.rows_from_pairs(pairs, seq_len, get_key(cfg, "packing"), tokenizer.pad_id)


def make_data_iterator(cfg: Any, process_index: int, process_count: int,
                       per_process_batch_size: int) -> DataIterator:
  """Builds this process's endless, resumable batch iterator.

  Args:
    cfg: any object with the attributes in ``validation.DATA_CONFIG_KEYS``.
    process_index: this process's index in ``[0, process_count)``.
    process_count: number of processes; each reads a disjoint share of documents
      (synthetic: of rows).
    per_process_batch_size: rows per batch on this process.

  Raises:
    DataError: a bad config key (see ``validate_data_config``) or bad arguments.
  """
  if not 0 <= process_index < process_count:
    raise DataError(f"process_index={process_index} must be in [0, {process_count})")
  if per_process_batch_size < 1:
    raise DataError(f"per_process_batch_size={per_process_batch_size} must be >= 1")
  tokenizer = validate_data_config(cfg)
  rows = _row_dataset(cfg, tokenizer, process_index, process_count)
  batches = rows.batch(per_process_batch_size, drop_remainder=True)
  workers = get_key(cfg, "grain_worker_count")
  if workers > 0:
    batches = batches.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
  fingerprint = {k: get_key(cfg, k) for k in DATA_CONFIG_KEYS if k not in _RESUMABLE_KEYS}
  fingerprint.update(per_process_batch_size=per_process_batch_size, process_count=process_count)
  return DataIterator(batches, tokenizer, fingerprint)
