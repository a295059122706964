"""LoRA: low-rank adapters on the dense projections of any model, the base frozen.

Our own adapters, not qwix's `LoraProvider`: qwix finds the weight of an intercepted
`dot_general` by identity with a module attribute and creates the adapters lazily during the first
call, but our projections (`linear.DenseGeneral`) cast and reshape the kernel before a plain 2-D
matmul, the pattern stack calls its layers through `nnx.merge` inside `jax.lax.scan` and
`jax.checkpoint` (nothing created there survives), and qwix derives an adapter's sharding from a
concrete array's `NamedSharding`, where ours come from `logical_axes` and the rules table.

`attach(model, rank, alpha, targets, rngs)` gives every `DenseGeneral` whose module path ("/"
joined, e.g. "decoder/runs/0/0/attention/query" scanned, "decoder/layers/3/mlp/up" unscanned)
matches the regex `targets` two parameters next to its kernel [*lead, *in, *out] (lead: the
pattern stack's "layers" axis when scanned):
    lora_a [*lead, *in, rank]   logical axes (*lead, *in axes, None)   uniform ±1/sqrt(fan_in)
    lora_b [*lead, rank, *out]  logical axes (*lead, None, *out axes)  zeros
so the projection computes x W + (alpha / rank) (x A) B, starts exactly equal to the base, and each
adapter is sharded by the rules like the weight it adapts. `targets` "" takes every projection
with at least one named axis on its input side and one on its output side and no "vocab" axis:
attention and MLP projections of any family, and fused ones whose packed dimension is unnamed
(Gated DeltaNet's in_proj_qkvz [embed, heads, None]); not a router or a gate to one value (their
output axis is unnamed), a norm (not a projection) or the output head. Experts kept as raw stacked
arrays (MoE) are not projections and get no adapters.

Parameters stay one tree; `split` / `join` cut it into the adapters (trained) and the rest
(frozen), by the adapters' names, which belong to this module.
"""
from __future__ import annotations

import math
import re
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, traverse_util

from MaxText.layers.linear import DenseGeneral

ADAPTERS = ("lora_a", "lora_b")


def default_target(axes: tuple, in_rank: int) -> bool:
  """`axes`: a kernel's logical axes [*in, *out] (no "layers"): a named axis on each side, no vocab."""
  named = lambda side: any(a is not None for a in side)
  return named(axes[:in_rank]) and named(axes[in_rank:]) and "vocab" not in axes


def targets(model: nnx.Module, pattern: str) -> list[tuple[str, DenseGeneral]]:
  """[(module path, projection)] that `pattern` ("" = `default_target`) selects."""
  regex = re.compile(pattern) if pattern else None
  out = []
  for path, node in nnx.iter_graph(model):
    if not isinstance(node, DenseGeneral):
      continue
    name = "/".join(map(str, path))
    axes = tuple(node.kernel.get_metadata().get("logical_axes") or ())
    if (regex.search(name) if regex
        else default_target(tuple(a for a in axes if a != "layers"), node.in_rank)):
      out.append((name, node))
  return out


def attach(model: nnx.Module, rank: int, alpha: float, pattern: str, rngs: nnx.Rngs) -> list[str]:
  """Adds adapters to the projections `pattern` selects (module docstring); their paths.
  ValueError when it selects none."""
  chosen = targets(model, pattern)
  if not chosen:
    raise ValueError(f"lora_targets={pattern!r} selects no dense projection of this model")
  for _, dense in chosen:
    kernel = dense.kernel
    shape, axes = kernel.get_value().shape, tuple(kernel.get_metadata()["logical_axes"])
    lead = len(shape) - dense.in_rank - dense.out_rank
    ins = shape[lead:lead + dense.in_rank]
    bound = 1.0 / math.sqrt(math.prod(ins))
    a = jax.random.uniform(rngs.params(), (*shape[:lead + dense.in_rank], rank), jnp.float32,
                           -bound, bound).astype(kernel.get_value().dtype)
    b = jnp.zeros((*shape[:lead], rank, *shape[lead + dense.in_rank:]), kernel.get_value().dtype)
    dense.lora_a = nnx.Param(a, logical_axes=(*axes[:lead + dense.in_rank], None))
    dense.lora_b = nnx.Param(b, logical_axes=(*axes[:lead], None, *axes[lead + dense.in_rank:]))
    dense.lora_scale = float(alpha) / rank
  return [name for name, _ in chosen]


def is_adapter(path: tuple) -> bool:
  return bool(path) and path[-1] in ADAPTERS


def split(params: Any) -> tuple[dict, dict]:
  """(the adapters, everything else) of a parameter tree (nested dicts)."""
  flat = traverse_util.flatten_dict(params)
  return (traverse_util.unflatten_dict({k: v for k, v in flat.items() if is_adapter(k)}),
          traverse_util.unflatten_dict({k: v for k, v in flat.items() if not is_adapter(k)}))


def join(adapters: dict, base: dict) -> dict:
  return traverse_util.unflatten_dict({**traverse_util.flatten_dict(base),
                                       **traverse_util.flatten_dict(adapters)})


def merge_kernel(w: Any, a: Any, b: Any, scale: float) -> Any:
  """W + scale * A B in float32, cast back to W's dtype, for W [*lead, *in, *out], A [*lead, *in, r],
  B [*lead, r, *out] (any `lead`); NumPy arrays or jax.Arrays (on their devices) alike."""
  lead = a.ndim + b.ndim - w.ndim - 2
  r = a.shape[-1]
  a, b = a.astype("float32"), b.astype("float32")
  delta = a.reshape(*a.shape[:lead], -1, r) @ b.reshape(*b.shape[:lead], r, -1)
  return (w.astype("float32") + scale * delta.reshape(w.shape)).astype(w.dtype)


def merged(params: Any, scale: float) -> dict:
  """The parameters (host arrays) with every adapted kernel replaced by W + scale * A B
  (`merge_kernel`) and no adapters: what the adapted model computes, as a plain model."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  flat = traverse_util.flatten_dict(params)
  out = {k: v for k, v in flat.items() if not is_adapter(k)}
  for k, a in flat.items():
    if k[-1] != "lora_a":
      continue
    where = k[:-1]
    out[(*where, "kernel")] = merge_kernel(np.asarray(out[(*where, "kernel")]), np.asarray(a),
                                           np.asarray(flat[(*where, "lora_b")]), scale)
  return traverse_util.unflatten_dict(out)
