"""The optimizer state sharded over the data axes (ZeRO-1, MaxText's `shard_optimizer_over_data`).

Under data parallelism every device holds the whole of each parameter's data-axis replica, and
without this every device would keep all of the AdamW moments and run the whole update. Here each
moment takes its parameter's sharding plus the mesh's *data axes* on one dimension they divide:
gradients are reduce-scattered onto that sharding, the update runs on each device's part, and the
new parameters are all-gathered back to their own sharding (train/step.py).

The data axes are the mesh axes (of size > 1) the batch is split over (the rules of
"activation_batch") on which no parameter is sharded: with fsdp the parameters are already split
over fsdp, and only the remaining `data` axis is added.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from MaxText.sharding.rules import Rules

BATCH_AXIS = "activation_batch"
STACKED_AXIS = "layers"   # the layer scan's axis: the scan's gradient is written layer by layer


def _axes_of(entry) -> tuple[str, ...]:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def data_axes(mesh: Mesh, rules: Rules, param_shardings: Any) -> tuple[str, ...]:
  """The mesh axes of size > 1 the batch is split over and no parameter is sharded on."""
  used = {a for sh in jax.tree.leaves(param_shardings) for entry in sh.spec
          for a in _axes_of(entry)}
  batch = [a for name, axes in rules if name == BATCH_AXIS for a in axes]
  return tuple(dict.fromkeys(a for a in batch if a not in used and mesh.shape[a] > 1))


def add_data_axes(sharding: NamedSharding, shape: Sequence[int], logical_axes: Sequence[str | None],
                  axes: Sequence[str]) -> NamedSharding:
  """`sharding` with `axes` appended on the first dimension (not the stacked layers) whose size
  the combined split divides; unchanged when none does (that moment stays replicated over them)."""
  mesh = sharding.mesh
  spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
  n = math.prod(mesh.shape[a] for a in axes)
  for i, (name, size) in enumerate(zip(logical_axes, shape)):
    current = _axes_of(spec[i])
    if name == STACKED_AXIS or size % (math.prod(mesh.shape[a] for a in current) * n):
      continue
    combined = (*current, *axes)
    spec[i] = combined[0] if len(combined) == 1 else combined
    return NamedSharding(mesh, PartitionSpec(*spec))
  return sharding


def optimizer_shardings(param_shardings: Any, shapes: Any, logical_axes: Any,
                        axes: Sequence[str]) -> Any:
  """Per parameter: the sharding of its optimizer moments and of its update (ZeRO-1) — its own
  plus `axes` (`data_axes`)."""
  if not axes:
    return param_shardings
  is_axes = lambda x: isinstance(x, tuple) and all(isinstance(a, (str, type(None))) for a in x)
  return jax.tree.map(lambda names, sh, s: add_data_axes(sh, s.shape, names, axes),
                      logical_axes, param_shardings, shapes, is_leaf=is_axes)
