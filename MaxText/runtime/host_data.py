"""Which rows of the global batch this process feeds, and so which data shards it reads.

The global batch `[B, S]` is cut into `data_shards` blocks of `B / data_shards` rows, block `s`
from data shard `s` (`MaxText/data/pipeline.py`). A process feeds exactly the rows its own devices
hold under the batch sharding (`jax.make_array_from_process_local_data` takes them in that
order), so it reads the shards covering those rows: one shard per process by default, every shard
when the batch is replicated over the processes. Nothing here depends on the process count except
through the sharding, which is why a run can resume on another number of processes.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, cast

import jax
from jax.sharding import Sharding

from MaxText.config.load import ConfigError
from MaxText.data.errors import DataError


@dataclasses.dataclass(frozen=True)
class DataLayout:
  num_shards: int          # data shards the global batch is cut into
  shard_batch: int         # rows per shard per global batch
  rows: tuple[int, int]    # [start, stop) rows of the global batch this process feeds
  shard_ids: tuple[int, ...]
  source: str              # where num_shards came from, for the log

  def describe(self, global_batch: int) -> str:
    ids = self.shard_ids
    which = f"{ids[0]}" if len(ids) == 1 else f"{ids[0]}-{ids[-1]}"
    return (f"feeds rows {self.rows[0]}-{self.rows[1] - 1} of the global batch of {global_batch}:"
            f" data shard{'s' if len(ids) > 1 else ''} {which} of {self.num_shards} "
            f"({self.shard_batch} rows each; data_shards from {self.source})")


def process_rows(sharding: Sharding, shape: tuple[int, ...]) -> tuple[int, int]:
  """[start, stop) along dimension 0 held by this process's devices (must be contiguous)."""
  # (jax types the map's values `Index | None`; a sharding gives every device an index)
  indices = cast(Mapping[Any, tuple[slice, ...]], sharding.addressable_devices_indices_map(shape))
  spans = sorted({(sl[0].start or 0, shape[0] if sl[0].stop is None else sl[0].stop)
                  for sl in indices.values()})
  start, stop = spans[0]
  for a, b in spans[1:]:
    if a > stop:
      raise ConfigError(
          f"the batch sharding gives process {jax.process_index()} non-contiguous rows "
          f"{spans} of the global batch; reorder mesh_axes or the ici/dcn_*_parallelism so that "
          "each host's devices hold one block of rows")
    stop = max(stop, b)
  return start, stop


def data_layout(data_shards: int, saved_shards: int | None, process_count: int,
                global_batch: int, rows: tuple[int, int]) -> DataLayout:
  """The shards this process reads. `data_shards` 0 = the checkpoint's `saved_shards` when
  resuming, else one shard per process. ConfigError for an explicit or default count that does not
  fit the batch; DataError for a checkpoint's count that does not (exit 3)."""
  if data_shards and saved_shards and data_shards != saved_shards:
    raise DataError(f"data_shards={data_shards}, but the checkpoint being resumed was saved with "
                    f"data_shards={saved_shards}; its iterator positions are per shard, so resume "
                    f"with data_shards={saved_shards} (or 0: as saved)")
  if data_shards:
    num, source, error = data_shards, "data_shards", ConfigError
  elif saved_shards:
    num, source, error = saved_shards, "the checkpoint", DataError
  else:
    num, source, error = process_count, "the process count", ConfigError
  what = "data_shards" if source == "data_shards" else f"data_shards={num} (from {source})"
  if global_batch % num:
    raise error(f"{what} does not divide the global batch of {global_batch} sequences")
  shard_batch = global_batch // num
  start, stop = rows
  if start % shard_batch or stop % shard_batch:
    raise error(
        f"{what}: process {jax.process_index()} feeds rows {start}-{stop - 1} of the global batch "
        f"of {global_batch}, which do not fall on the blocks of {shard_batch} rows of the "
        f"{num} shards (choose data_shards so that each process's rows are whole blocks)")
  return DataLayout(num, shard_batch, rows, tuple(range(start // shard_batch, stop // shard_batch)),
                    source)
