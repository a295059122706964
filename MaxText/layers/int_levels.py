"""The integer form of a weight [*lead, *in, *out] (lead: stacked axes, e.g. the scan's layers and
the experts), shared by the quantized projections and routed experts (layers/quant.py,
layers/quant_experts.py) and by MaxText/quantization/ (RTN, GPTQ, the conversion): int8 levels, or
int4 levels packed two per uint8 along the last axis (so every other dimension keeps its size), and
float32 scales per group of consecutive rows of the flattened input and output column."""
from __future__ import annotations

import math
from types import ModuleType
from typing import Any, overload

import jax
import jax.numpy as jnp
import numpy as np

# an integer-weight matmul of fewer rows (a decoding step) pads them to MIN_ROWS with zeros: XLA
# runs a one-row product as a matrix-vector loop that converts the levels apart, not inside the dot
# (layers/quant.py: grouped_int_matmul, layers/quant_vocab.py: int_table_matmul)
MIN_ROWS = 8


def pack_int4(q: np.ndarray, axis: int) -> np.ndarray:
  """Two int4 levels per uint8 along `axis` (even index: low nibble), halving that axis."""
  q = np.moveaxis(np.asarray(q, np.int8), axis, -1)
  if q.shape[-1] % 2:
    raise ValueError(f"int4 packing needs an even size along the packed axis, got {q.shape[-1]}")
  u = (q.astype(np.int16) & 0xF).astype(np.uint8)
  return np.moveaxis(u[..., 0::2] | (u[..., 1::2] << 4), -1, axis)


@overload
def unpack_int4(p: np.ndarray, axis: int) -> np.ndarray: ...
@overload
def unpack_int4(p: jax.Array, axis: int) -> jax.Array: ...


def unpack_int4(p: jax.Array | np.ndarray, axis: int) -> jax.Array | np.ndarray:
  """The int8 levels of `pack_int4` (doubling `axis`); a NumPy array unpacks with NumPy (on the
  host, no program compiled per shape)."""
  if isinstance(p, np.ndarray):
    return _unpack_int4(np, p, axis)
  return _unpack_int4(jnp, p, axis)


def _unpack_int4(xp: ModuleType, p: Any, axis: int) -> Any:
  """`unpack_int4` with the array module `xp` (numpy or jax.numpy)."""
  p = xp.moveaxis(p, axis, -1)
  both = xp.stack([(p & 0xF), (p >> 4)], axis=-1).astype(np.int8)
  both = xp.where(both >= 8, both - 16, both).astype(np.int8)
  return xp.moveaxis(both.reshape(*p.shape[:-1], p.shape[-1] * 2), -1, axis)


def group_size_for(k: int, group_size: int) -> int:
  """Rows per group for an input of K (0 or >= K: one group); ValueError when it does not divide."""
  gs = k if group_size <= 0 or group_size >= k else group_size
  if k % gs:
    raise ValueError(f"group_size={group_size} does not divide the input size {k}")
  return gs


def int_layout(shape: tuple, axes: tuple, lead: int, in_rank: int, bits: int, group_size: int
               ) -> tuple[tuple, Any, tuple, tuple]:
  """(levels' shape, their dtype, scale shape, scale logical axes) of a weight [*lead, *in, *out]
  quantized as the matrices [prod(in), prod(out)]."""
  k = math.prod(shape[lead:lead + in_rank])
  gs = group_size_for(k, group_size)
  out = shape[lead + in_rank:]
  if bits == 4:
    if shape[-1] % 2:
      raise ValueError(f"bits=4 packs two levels per byte along the kernel's last axis, which "
                       f"needs an even size; it is {shape[-1]}")
    shape = (*shape[:-1], shape[-1] // 2)
  return (shape, jnp.uint8 if bits == 4 else jnp.int8, (*shape[:lead], k // gs, *out),
          (*axes[:lead], None, *axes[lead + in_rank:]))
