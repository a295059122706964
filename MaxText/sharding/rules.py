"""Logical axis names → mesh PartitionSpecs, through the `logical_axis_rules` table.

Model code names the logical axes of each parameter (`logical_axes=("embed", "mlp")` metadata) and
of activations (`constrain(x, ("activation_batch", "activation_length", "activation_embed"))`); only
this module knows mesh axes. For each array dimension the rules for its logical name are tried in
order and the first one is taken whose mesh axes (a) are not already used by another dimension of
the same array and (b) divide the dimension's size. If none fits, that dimension is replicated.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass
from typing import Any, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from MaxText.config.load import ConfigError

Rules = tuple[tuple[str, tuple[str, ...]], ...]


def parse_rules(raw: Sequence[Any], mesh_axes: Sequence[str]) -> Rules:
  """Checks the YAML table (list of [name, axes|null]) and returns it as tuples."""
  out = []
  for i, row in enumerate(raw):
    if not (isinstance(row, (list, tuple)) and len(row) == 2 and isinstance(row[0], str)):
      raise ConfigError(f"logical_axis_rules[{i}]={row!r}: expected [logical_name, mesh_axes|null]")
    name, axes = row
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    for a in axes:
      if a not in mesh_axes:
        raise ConfigError(f"logical_axis_rules[{i}] ({name}): mesh axis '{a}' is not in mesh_axes "
                          f"{list(mesh_axes)}")
    out.append((name, axes))
  return tuple(out)


def logical_to_spec(logical_axes: Sequence[str | None], shape: Sequence[int], rules: Rules,
                    mesh: Mesh) -> PartitionSpec:
  if len(logical_axes) != len(shape):
    raise ValueError(f"logical axes {tuple(logical_axes)} do not match shape {tuple(shape)}")
  # A mesh axis shards one dimension at most. One of size 1 shards nothing, so a rule that names
  # it again (the `stage` axis of `layers` and of `activation_batch` when there is no pipeline)
  # is not blocked by it: the axis is only left out of the second spec.
  used: set[str] = set()
  spec: list[Any] = []
  for name, size in zip(logical_axes, shape):
    chosen: tuple[str, ...] = ()
    for rule_name, axes in rules:
      if rule_name != name or any(mesh.shape[a] > 1 for a in used.intersection(axes)):
        continue
      if size % math.prod(mesh.shape[a] for a in axes) == 0:
        chosen = tuple(a for a in axes if a not in used)
        break
    used.update(chosen)
    spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else chosen)
  return PartitionSpec(*spec)


# ---- activation constraints, used from inside model code ---------------------------------------
@dataclass(frozen=True)
class ShardingContext:
  mesh: Mesh
  rules: Rules


_CONTEXT: contextvars.ContextVar[ShardingContext | None] = contextvars.ContextVar("sharding", default=None)


@contextlib.contextmanager
def use_rules(mesh: Mesh, rules: Rules):
  """Makes `constrain` active (inside: traced model code annotates its activations)."""
  token = _CONTEXT.set(ShardingContext(mesh, rules))
  try:
    yield
  finally:
    _CONTEXT.reset(token)


def current_context() -> ShardingContext | None:
  return _CONTEXT.get()


@contextlib.contextmanager
def without_rules():
  """Makes `constrain` a no-op again (inside a `shard_map` body, where arrays are per-device)."""
  token = _CONTEXT.set(None)
  try:
    yield
  finally:
    _CONTEXT.reset(token)


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
  """`with_sharding_constraint` by logical names; a no-op outside `use_rules`."""
  ctx = _CONTEXT.get()
  if ctx is None:
    return x
  spec = logical_to_spec(logical_axes, x.shape, ctx.rules, ctx.mesh)
  return jax.lax.with_sharding_constraint(x, NamedSharding(ctx.mesh, spec))


# ---- the token batch ---------------------------------------------------------------------------
BATCH_AXES = ("activation_batch", "activation_length")


def batch_sharding(mesh: Mesh, rules: Rules, global_batch: int, seq_len: int) -> NamedSharding:
  """The sharding of a [global_batch, seq_len] token array (training's batch, the tools' too)."""
  return NamedSharding(mesh, logical_to_spec(BATCH_AXES, (global_batch, seq_len), rules, mesh))


def rows_like(token_sharding: NamedSharding, ndim: int) -> NamedSharding:
  """The sharding of a batch array of `ndim` dimensions whose rows go as the token batch's
  (`batch_sharding`): its first axis split the same way, the rest whole (e.g. a row's media)."""
  first = token_sharding.spec[0] if len(token_sharding.spec) else None
  return NamedSharding(token_sharding.mesh, PartitionSpec(first, *([None] * (ndim - 1))))


# ---- parameters --------------------------------------------------------------------------------
def tree_shardings(logical_tree: Any, shape_tree: Any, mesh: Mesh, rules: Rules) -> Any:
  """NamedShardings for a tree of logical-axis tuples (leaves) and a matching tree of shapes."""
  is_axes = lambda x: isinstance(x, tuple) and all(isinstance(a, (str, type(None))) for a in x)
  return jax.tree.map(
      lambda axes, s: NamedSharding(mesh, logical_to_spec(axes, s.shape, rules, mesh)),
      logical_tree, shape_tree, is_leaf=is_axes)


def sharding_report(shape_tree: Any, sharding_tree: Any) -> str:
  """Parameter bytes per device, the share of parameter bytes that is sharded, and per mesh axis
  of more than one device the share split over it (e.g. `stage`: the stacked layers)."""
  total = per_device = sharded = 0
  by_axis: dict[str, int] = {}
  for s, sh in zip(jax.tree.leaves(shape_tree), jax.tree.leaves(sharding_tree)):
    nbytes = math.prod(s.shape) * s.dtype.itemsize
    shard_shape = sh.shard_shape(s.shape)
    local = math.prod(shard_shape) * s.dtype.itemsize
    total += nbytes
    per_device += local
    if local < nbytes:
      sharded += nbytes
    for entry in getattr(sh, "spec", ()):
      for axis in (entry if isinstance(entry, tuple) else (entry,)):
        if axis is not None and sh.mesh.shape[axis] > 1:
          by_axis[axis] = by_axis.get(axis, 0) + nbytes
  share = 100.0 * sharded / total if total else 0.0
  axes = ", ".join(f"{a} {100.0 * n / total:.1f}%" for a, n in by_axis.items())
  return (f"parameters: {total / 2**20:,.1f} MiB in all, {per_device / 2**20:,.2f} MiB per device; "
          f"{share:.1f}% of parameter bytes sharded" + (f" (split over {axes})" if axes else ""))
