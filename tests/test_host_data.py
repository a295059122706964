"""Which rows of the global batch a process feeds and which data shards that is
(`MaxText/runtime/host_data.py`); errors name the key."""
import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from MaxText.config.load import ConfigError
from MaxText.data.errors import DataError
from MaxText.runtime.host_data import data_layout, process_rows


def test_process_rows_follow_the_batch_sharding():
  mesh = Mesh(np.asarray(jax.devices()).reshape(4, 2), ("data", "tensor"))
  # one process holds every device: all rows, whether the batch is split or replicated
  assert process_rows(NamedSharding(mesh, PartitionSpec("data")), (8, 16)) == (0, 8)
  assert process_rows(NamedSharding(mesh, PartitionSpec()), (8, 16)) == (0, 8)
  # per-process rows of a real multi-process run: tests/test_multiprocess.py (rows 0-3 and 4-7)


@pytest.mark.parametrize("args, want", [
    ((0, None, 2, 8, (4, 8)), (2, 4, (1,), "the process count")),
    ((0, 2, 1, 8, (0, 8)), (2, 4, (0, 1), "the checkpoint")),
    ((4, None, 2, 16, (8, 16)), (4, 4, (2, 3), "data_shards")),
])
def test_data_layout(args, want):
  layout = data_layout(*args)
  assert (layout.num_shards, layout.shard_batch, layout.shard_ids, layout.source) == want


@pytest.mark.parametrize("args, error, message", [
    ((4, 2, 1, 8, (0, 8)), DataError, "saved with data_shards=2; .* resume with data_shards=2"),
    ((3, None, 1, 8, (0, 8)), ConfigError, "data_shards does not divide the global batch of 8"),
    ((0, 3, 1, 8, (0, 8)), DataError, r"data_shards=3 \(from the checkpoint\) does not divide"),
    ((0, None, 2, 8, (2, 6)), ConfigError, "feeds rows 2-5 .* blocks of 4 rows"),
])
def test_data_layout_refusals(args, error, message):
  with pytest.raises(error, match=message):
    data_layout(*args)
