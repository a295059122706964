"""RMSNorm (Llama form: normalise in fp32, cast back to the compute dtype, multiply the scale)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from MaxText.layers.linear import param


class RMSNorm(nnx.Module):
  def __init__(self, dim: int, *, eps: float, rngs: nnx.Rngs, dtype: jnp.dtype,
               param_dtype: jnp.dtype, logical_axis: str = "norm"):
    self.scale = param(rngs, (dim,), (logical_axis,), std=None, dtype=param_dtype)
    self.eps = eps
    self.dtype = dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return y.astype(self.dtype) * self.scale[...].astype(self.dtype)
