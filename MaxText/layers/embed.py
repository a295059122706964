"""Embedding lookup that stays sharded.

The table [V, D] is split like any parameter (by default D over `fsdp`, V over `tensor`); the
looked-up rows [B, S, D] are wanted split over the batch axes (`data`, `fsdp`, `expert`). Going
straight from "D over fsdp" to "B over data x fsdp" is a resharding XLA's SPMD partitioner cannot
do efficiently: it warns "Involuntary full rematerialization" and replicates the whole activation
on every device first. So the lookup goes in two steps: rows over the batch axes the table's D
does not use (D keeps the table's split: no communication), then the activation sharding (an
all-to-all over the shared axes only).
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from MaxText.sharding.rules import constrain, current_context, logical_to_spec


def _axes(entry) -> tuple[str, ...]:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def lookup(table_VD: jax.Array, tokens_BS: jax.Array, table_axes: Sequence[str | None],
           out_axes: Sequence[str | None]) -> jax.Array:
  """table[tokens] ([B, S, D]) constrained to `out_axes`; `table_axes` are the table's logical
  axes (its parameter metadata)."""
  x_BSD = jnp.take(table_VD, tokens_BS, axis=0)
  ctx = current_context()
  if ctx is None:
    return x_BSD
  table_spec = logical_to_spec(table_axes, table_VD.shape, ctx.rules, ctx.mesh)
  d_axes = _axes(table_spec[1])
  out_spec = logical_to_spec(out_axes, x_BSD.shape, ctx.rules, ctx.mesh)
  rows = tuple(a for a in _axes(out_spec[0]) if a not in d_axes)
  step = P(rows or None, None, d_axes or None)
  x_BSD = jax.lax.with_sharding_constraint(x_BSD, NamedSharding(ctx.mesh, step))
  return constrain(x_BSD, out_axes)
