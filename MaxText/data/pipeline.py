"""The training input pipeline: config -> resumable iterator of packed numpy batches.

The data is split into `data_shards` shards; the global batch is their blocks of rows stacked in
shard order, and each process reads only the shards whose rows its devices hold (usually one), so
the global batch is the same for any process count. Grain dataset graph (per shard)::

    documents (MapDataset, random access)
      -> minus the held-out documents     eval_split_fraction (sources.held_out): evaluation's
      -> [shard::num_shards]              disjoint document share per data shard
      -> shuffle(data_shuffle_seed)       a new permutation every epoch (if `shuffle`)
      -> repeat()                         endless epochs
      -> map(tokenize -> pairs)           runs on Grain's read threads
      -> to_iter_dataset
      -> skip bad records                 counted, at most `max_bad_records` (bad_records.py)
      -> pack (or chunk) into rows of max_target_length
      -> batch(shard_batch_size, drop_remainder=True)
      -> mp_prefetch(grain_worker_count)  optional worker processes

``dataset_type="synthetic"`` replaces everything before ``batch`` with
deterministic random rows. Every stage is checkpointable, so
``DataIterator.get_state``/``set_state`` resume bit-exactly (one state per shard, so another
process count resumes too); the state carries a fingerprint of the data config and shard layout,
and a state from another config is refused (DataError).
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import grain
import numpy as np

from MaxText.config.schema import DATA_KEYS, KEYS, default
from MaxText.data import bad_records
from MaxText.data import media_rows
from MaxText.data import packing
from MaxText.data import sft
from MaxText.data import sources
from MaxText.data import synthetic
from MaxText.data.config import DataConfig
from MaxText.data.multimodal.processor import Processor
from MaxText.data.errors import DataError
from MaxText.data.tokenizers import Tokenizer
from MaxText.data.validation import validate_data_config

# Data keys that may change between a save and its resume (everything else must match).
_RESUMABLE_KEYS = ("max_bad_records",)

# Read-ahead of the document stage; small because documents can be large.
_READ_OPTIONS = grain.ReadOptions(num_threads=4, prefetch_buffer_size=64)


class DataIterator:
  """Iterator of batches: dicts of int32 arrays ``[rows, max_target_length]``.

  The global batch is cut into `num_shards` equal blocks of rows, block ``s`` always coming from
  data shard ``s`` (its own disjoint share of the documents or synthetic rows, its own Grain
  pipeline). This iterator reads the shards in `shard_ids` (consecutive) and yields their blocks
  stacked in shard order, so the global batch does not depend on how many processes read it.

  Keys are ``MaxText.data.batch.BATCH_KEYS``. ``get_state()`` returns a JSON-serialisable dict (one Grain
  state per shard); after ``set_state(state)`` the next batch equals the one that followed
  ``state``. `fingerprint` (the data config and shard layout) travels with the state and must
  match. ``set_state`` accepts a state holding more shards than this iterator reads (states merged
  from several processes' files) and takes its own.
  """

  def __init__(self, shards: dict[int, grain.IterDataset], tokenizer,
               fingerprint: dict | None = None, num_shards: int | None = None):
    self.tokenizer = tokenizer
    self.fingerprint = fingerprint
    self.shard_ids = tuple(sorted(shards))
    self.num_shards = num_shards if num_shards is not None else len(self.shard_ids)
    self._iterators = {s: iter(shards[s]) for s in self.shard_ids}

  def __iter__(self) -> "DataIterator":
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    blocks = [next(self._iterators[s]) for s in self.shard_ids]
    if len(blocks) == 1:
      return blocks[0]
    return {k: np.concatenate([b[k] for b in blocks]) for k in blocks[0]}

  def get_state(self) -> dict:
    """Grain's iterator state per shard, encoded so ``json.dumps`` round-trips it exactly."""
    return {"shards": {str(s): _encode_state(it.get_state()) for s, it in self._iterators.items()},
            "fingerprint": self.fingerprint}

  def set_state(self, state: dict) -> None:
    """Restores a state from ``get_state`` (possibly after a JSON round trip).

    Raises:
      DataError: the state is not one, lacks one of this iterator's shards, or belongs to another
        data config or shard layout.
    """
    if not isinstance(state, dict) or not isinstance(state.get("shards"), dict):
      raise DataError(f"data iterator state must come from DataIterator.get_state, got "
                      f"{type(state).__name__}" + (" (keys " + ", ".join(map(str, state)) + ")"
                                                    if isinstance(state, dict) else ""))
    saved = state.get("fingerprint")
    if isinstance(saved, dict) and self.fingerprint is not None:
      # a data key added after the state was written reads as its default there
      saved = {**{k: default(k) for k in self.fingerprint if k not in saved and k in KEYS},
               **saved}
    if self.fingerprint is not None and saved != self.fingerprint:
      if not isinstance(saved, dict):
        raise DataError("data iterator state has no data config fingerprint (written by another "
                        "version); refusing to guess where the stream was")
      diff = [f"{k}: saved {saved.get(k)!r}, now {self.fingerprint.get(k)!r}"
              for k in sorted(set(saved) | set(self.fingerprint))
              if saved.get(k) != self.fingerprint.get(k)]
      raise DataError("data iterator state was saved for another data config (" + "; ".join(diff)
                      + "); resume with the same data keys, or start a new run_name")
    missing = [s for s in self.shard_ids if str(s) not in state["shards"]]
    if missing:
      raise DataError(f"data iterator state has no position for data shard(s) {missing} of "
                      f"{self.num_shards} (it has {sorted(state['shards'], key=int)})")
    try:
      for s, it in self._iterators.items():
        it.set_state(_decode_state(copy.deepcopy(state["shards"][str(s)])))
    except (KeyError, IndexError, TypeError, ValueError) as e:
      raise DataError(f"data iterator state does not fit this pipeline: {type(e).__name__}: "
                      f"{e}") from e

  def close(self) -> None:
    """Stops Grain worker processes, if any."""
    for it in self._iterators.values():
      close = getattr(it, "close", None)
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


def media_slots(dcfg: DataConfig, tokenizer: Tokenizer | None) -> media_rows.MediaSlots | None:
  """Each SFT row's image / audio slots (media_rows.py); None for text rows. DataError naming the
  key when the tokenizer's folder has no processor for them, or with packing."""
  if not dcfg.sft or not (dcfg.max_num_images_per_example or dcfg.max_num_audio_per_example):
    return None
  if dcfg.packing:
    raise DataError("max_num_images_per_example / max_num_audio_per_example: rows with images "
                    "or audio are not packed; set packing=false")
  return media_rows.slots_for(Processor.for_tokenizer(tokenizer),
                              dcfg.max_num_images_per_example, dcfg.max_num_audio_per_example,
                              dcfg.max_audio_seconds)


def row_dataset(dcfg: DataConfig, tokenizer: Tokenizer | None, shard: int, num_shards: int, *,
                split: str = "train", endless: bool = True) -> grain.IterDataset:
  """Unbatched rows of one data shard (see the module docstring for the graph). `split`: the
  documents training reads ("train": all but the `eval_split_fraction` held out), the held-out
  ones ("eval") or "all"; `endless=False`: one pass in order (no shuffle; evaluation)."""
  seq_len, seed = dcfg.max_target_length, dcfg.data_shuffle_seed
  if dcfg.dataset_type == "synthetic":
    rows = synthetic.synthetic_rows(seed, seq_len, dcfg.vocab_size, shard, num_shards)
    return rows.to_iter_dataset(_READ_OPTIONS)
  if tokenizer is None:   # (validate_data_config gives None for synthetic data only)
    raise DataError(f"dataset_type '{dcfg.dataset_type}' needs the tokenizer "
                    f"(tokenizer_path '{dcfg.tokenizer_path}')")

  if dcfg.sft:   # chat records: (record, where), tokenized with the assistant-token mask
    docs = sft.record_dataset(dcfg.dataset_path, dcfg.dataset_format,
                              eval_split_fraction=dcfg.eval_split_fraction, split=split)
  else:
    docs = sources.document_dataset(dcfg.dataset_type, dcfg.dataset_path, dcfg.dataset_format,
                                    dcfg.dataset_text_field, tolerant=True,
                                    eval_split_fraction=dcfg.eval_split_fraction, split=split)
  if len(docs) < num_shards:
    raise DataError(f"dataset_path '{dcfg.dataset_path}' has {len(docs)} documents, "
                    f"fewer than the {num_shards} data shards that must each read some")
  docs = docs[shard::num_shards]
  if endless:
    if dcfg.shuffle:
      docs = docs.shuffle(seed=seed)
    docs = docs.repeat()
  if dcfg.sft:
    slots = media_slots(dcfg, tokenizer)
    to_pairs = sft.ChatToPairs(sft.ChatFormat.for_tokenizer(dcfg.tokenizer_path,
                                                            dcfg.chat_template_path),
                               tokenizer, seq_len, dcfg.sft_train_on_completion_only,
                               dcfg.sft_overlong, Processor.for_tokenizer(tokenizer), slots)
  else:
    to_pairs = packing.TokenizeToPairs(tokenizer, dcfg.add_bos, dcfg.add_eos)
  pairs = docs.map(to_pairs).to_iter_dataset(_READ_OPTIONS)  # Drops None (too-short docs).
  pairs = bad_records.SkipBadRecords(pairs, dcfg.max_bad_records)
  if dcfg.sft:
    return sft.rows(pairs, seq_len, dcfg.packing, tokenizer.pad_id)
  return packing.rows_from_pairs(pairs, seq_len, dcfg.packing, tokenizer.pad_id)


def make_data_iterator(dcfg: DataConfig, process_index: int, process_count: int,
                       per_process_batch_size: int, tokenizer: Tokenizer | None = None
                       ) -> DataIterator:
  """This process's iterator when each of `process_count` processes reads one data shard (its
  own `per_process_batch_size` rows of every global batch): `make_shard_iterator(dcfg,
  [process_index], process_count, per_process_batch_size)`."""
  if not 0 <= process_index < process_count:
    raise DataError(f"process_index={process_index} must be in [0, {process_count})")
  return make_shard_iterator(dcfg, [process_index], process_count, per_process_batch_size,
                             tokenizer)


def make_shard_iterator(dcfg: DataConfig, shard_ids: Sequence[int], num_shards: int,
                        shard_batch_size: int, tokenizer: Tokenizer | None = None
                        ) -> DataIterator:
  """Builds the endless, resumable iterator of data shards `shard_ids` out of `num_shards`.

  Args:
    dcfg: the data config.
    shard_ids: consecutive shard indices in ``[0, num_shards)`` this process reads.
    num_shards: shards the data is split into; each reads a disjoint share of documents
      (synthetic: of rows), so the global batch is the same whatever the process count.
    shard_batch_size: rows each shard contributes to every batch.
    tokenizer: what ``validate_data_config(dcfg)`` returned (the trainer checks the config and
      loads the tokenizer once, before anything compiles); None: that is done here.

  Raises:
    DataError: a bad config key (see ``validate_data_config``) or bad arguments.
  """
  shard_ids = list(shard_ids)
  if num_shards < 1:
    raise DataError(f"num_shards={num_shards} must be >= 1")
  if not shard_ids or any(not 0 <= s < num_shards for s in shard_ids) or \
      shard_ids != list(range(shard_ids[0], shard_ids[0] + len(shard_ids))):
    raise DataError(f"shard_ids={shard_ids} must be consecutive indices in [0, {num_shards})")
  if shard_batch_size < 1:
    raise DataError(f"shard_batch_size={shard_batch_size} must be >= 1")
  if tokenizer is None:
    tokenizer = validate_data_config(dcfg)
  shards = {}
  for s in shard_ids:
    batches = row_dataset(dcfg, tokenizer, s, num_shards).batch(shard_batch_size,
                                                                 drop_remainder=True)
    if dcfg.grain_worker_count > 0:
      batches = batches.mp_prefetch(
          grain.MultiprocessingOptions(num_workers=dcfg.grain_worker_count))
    shards[s] = batches
  fingerprint = {k: getattr(dcfg, k) for k in DATA_KEYS if k not in _RESUMABLE_KEYS}
  fingerprint.update(shard_batch_size=shard_batch_size, data_shards=num_shards)
  return DataIterator(shards, tokenizer, fingerprint, num_shards)
