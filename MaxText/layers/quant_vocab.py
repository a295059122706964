"""Vocabulary tables in int8 (`weight_quant_vocab`, with `weight_bits=8`): generic code that reads a
model's tables through their owner and name, whichever form they are stored in.

A vocabulary table is a parameter [V, D] of the model itself whose first logical axis is "vocab"
(the embedding, Gemma's per-layer-input table `ple_embedding`), not a module's kernel. In its
integer form (`attach`) it holds int8 levels [V, D] and `<name>_scale` [V] (float32), one scale per
vocabulary row: RTN, symmetric, as the projections (quantization/gptq.py: `rtn` of the table seen
as the head's matrix [D, V] with one group). Its two uses read the levels only:
  * `rows` — a lookup gathers the tokens' int8 rows and their scales and returns levels x scale in
    the model's parameter dtype (what the float model's lookup gives on the dequantized table). On
    a TPU (one device) the rows come from kernels/row_gather.py: XLA's gather of an int8 row
    would copy the whole table into another tile layout every step;
  * `logits` — a tied LM head multiplies the hidden states by the int8 table (the levels converted
    inside the matmul, fp32 accumulation, rows padded to int_levels.MIN_ROWS as the projections' decoding
    matmul) and scales the logits: logits[:, v] = (x . q_v) * s_v — no float copy of the table.
An untied LM head is a projection (layers/quant.py: `targets(..., vocab=True)`, its scales per
group of input rows and output column = vocabulary row). A float table reads as before through the same functions.
"""
from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from MaxText.kernels import row_gather
from MaxText.layers import embed
from MaxText.layers.int_levels import MIN_ROWS
from MaxText.layers.linear import matmul
from MaxText.sharding.rules import constrain, current_context

SCALE = "_scale"   # the scales of table `name` are the parameter `name + SCALE`


def tables(model: nnx.Module, exclude: str = "") -> list[str]:
  """The names of `model`'s own vocabulary tables (module docstring), minus those the regex
  `exclude` searches; sorted."""
  regex = re.compile(exclude) if exclude else None
  out = []
  for name, value in sorted(vars(model).items()):
    if not isinstance(value, nnx.Param) or (regex and regex.search(name)):
      continue
    axes = tuple(value.get_metadata().get("logical_axes") or ())
    if len(value.get_value().shape) == 2 and axes[:1] == ("vocab",):
      out.append(name)
  return out


def attach(model: nnx.Module, exclude: str) -> list[str]:
  """Turns the tables into int8 levels + per-row scales (zeros until loaded); their names."""
  done = tables(model, exclude)
  for name in done:
    table = getattr(model, name)
    shape, axes = table.get_value().shape, tuple(table.get_metadata()["logical_axes"])
    setattr(model, name, nnx.Param(jnp.zeros(shape, jnp.int8), logical_axes=axes))
    setattr(model, name + SCALE, nnx.Param(jnp.zeros(shape[:1], jnp.float32),
                                           logical_axes=axes[:1]))
  return done


def _scale(owner: nnx.Module, name: str) -> jax.Array | None:
  scale = getattr(owner, name + SCALE, None)
  return None if scale is None else scale[...]


def rows(owner: nnx.Module, name: str, tokens_BS: jax.Array, dtype: Any,
         out_axes=None) -> jax.Array:
  """The rows of table `name` for the tokens ([*tokens, D]): a float table's as stored; an int8
  table's levels x scale in `dtype`. With `out_axes` the lookup stays sharded (layers/embed.py)."""
  param = getattr(owner, name)
  table = param[...]
  scale = _scale(owner, name)
  if scale is not None and _gather_kernel():
    x = row_gather.gather_rows(table, tokens_BS)
    x = x if out_axes is None else constrain(x, out_axes)
  elif out_axes is None:
    x = jnp.take(table, tokens_BS, axis=0)
  else:
    x = embed.lookup(table, tokens_BS, tuple(param.get_metadata()["logical_axes"]), out_axes)
  if scale is None:
    return x
  s = jnp.take(scale, tokens_BS, axis=0).astype(jnp.float32)
  return (x.astype(jnp.float32) * s[..., None]).astype(dtype)


def _gather_kernel() -> bool:
  """Whether int8 rows come from kernels/row_gather.py: on a TPU, the table on one device (the
  kernel is not partitioned; a sharded table takes XLA's gather)."""
  if jax.default_backend() != "tpu":
    return False
  ctx = current_context()
  return ctx is None or ctx.mesh.size == 1


def logits(owner: nnx.Module, name: str, x_MD: jax.Array) -> jax.Array:
  """x @ table^T in fp32 [M, V] (a tied LM head): a float table through `linear.matmul`, an int8
  one as `int_table_matmul`."""
  table, scale = getattr(owner, name)[...], _scale(owner, name)
  if scale is None:
    return matmul(x_MD, table, w_is_NK=True, out_dtype=jnp.float32)
  return int_table_matmul(x_MD, table, scale)


def int_table_matmul(x_MD: jax.Array, q_VD: jax.Array, scale_V: jax.Array) -> jax.Array:
  """(x @ q^T) * scale in fp32 [M, V]: the levels converted to x's dtype (exact) inside the matmul,
  the per-row scales on its output; fewer than MIN_ROWS rows padded with zeros (a one-row
  product would convert the levels apart, as for the projections)."""
  m = x_MD.shape[0]
  pad = max(m, MIN_ROWS) - m
  x = jnp.pad(x_MD, ((0, pad), (0, 0))) if pad else x_MD
  y = jax.lax.dot_general(x, q_VD.astype(x.dtype), (((1,), (1,)), ((), ())),
                          preferred_element_type=jnp.float32)
  y = y * scale_V.astype(jnp.float32)[None, :]
  return y[:m] if pad else y


def head_params(owner: nnx.Module, name: str) -> tuple[tuple[str, ...], ...]:
  """The parameters a tied head on table `name` reads (the table, and its scales when int8)."""
  return ((name,), (name + SCALE,)) if hasattr(owner, name + SCALE) else ((name,),)


def dequantized(owner: nnx.Module, name: str) -> jax.Array:
  """Table `name` as floats [V, D] (levels x scale in fp32 for an int8 table): a logit lens's."""
  table, scale = getattr(owner, name)[...], _scale(owner, name)
  if scale is None:
    return table
  return table.astype(jnp.float32) * scale.astype(jnp.float32)[:, None]

