"""Parameter helpers: every parameter carries its logical axis names as `logical_axes` metadata."""
from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx


def param(rngs: nnx.Rngs, shape: Sequence[int], logical_axes: Sequence[str | None], *,
          std: float | None, dtype: jnp.dtype) -> nnx.Param:
  """Normal(0, std) init (std=None → ones, for norm scales)."""
  if std is None:
    value = jnp.ones(shape, dtype)
  else:
    value = (std * jax.random.normal(rngs.params(), tuple(shape), jnp.float32)).astype(dtype)
  return nnx.Param(value, logical_axes=tuple(logical_axes))


class DenseGeneral(nnx.Module):
  """y = einsum(x, w): contracts the last `len(in_shape)` dims of x with w[in_shape + out_shape]."""

  def __init__(self, in_shape: Sequence[int], out_shape: Sequence[int], logical_axes: Sequence[str],
               *, rngs: nnx.Rngs, dtype: jnp.dtype, param_dtype: jnp.dtype):
    self.in_rank, self.out_rank = len(in_shape), len(out_shape)
    # LoRA adapters (layers/lora.py sets them): y += lora_scale * (x A) B
    self.lora_a = nnx.data(None)
    self.lora_b = nnx.data(None)
    self.lora_scale = 0.0
    fan_in = 1
    for d in in_shape:
      fan_in *= d
    self.kernel = param(rngs, (*in_shape, *out_shape), logical_axes, std=fan_in ** -0.5,
                        dtype=param_dtype)
    self.dtype = dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    # One 2-D matmul [tokens, in] @ [in, out]: XLA:CPU lays out and differentiates a plain 2-D dot
    # far better than a multi-dimensional dot_general (about 2x on a SwiGLU block, fwd+bwd).
    w = self.kernel[...].astype(self.dtype)
    batch_shape = x.shape[: x.ndim - self.in_rank]
    in_size = math.prod(w.shape[: self.in_rank])
    out_shape = w.shape[self.in_rank:]
    x2 = x.astype(self.dtype).reshape(-1, in_size)
    y = x2 @ w.reshape(in_size, -1)
    if self.lora_a is not None:   # A [*in, r], B [r, *out]; zero B: y exactly as without
      a = self.lora_a[...].astype(self.dtype).reshape(in_size, -1)
      b = self.lora_b[...].astype(self.dtype).reshape(a.shape[1], -1)
      y = y + self.lora_scale * ((x2 @ a) @ b)
    return y.reshape(*batch_shape, *out_shape)
