"""RMSNorm in the two cast orders the supported families use (identical in fp32, not in bf16):

  cast_before_scale=True   Llama / Qwen3: normalise in fp32, cast to the compute dtype, then multiply
                           by the scale (in the compute dtype).
  cast_before_scale=False  Gemma 4: normalise and multiply by the fp32 scale, cast once at the end.

`use_scale=False` is the scale-free variant (Gemma 4's v_norm and router norm). The scale is plain
`w` (initialised to 1), not `1 + w`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from MaxText.layers.linear import param


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
  """x / sqrt(mean(x^2) + eps) over the last axis, in fp32."""
  x32 = x.astype(jnp.float32)
  return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
  def __init__(self, dim: int, *, eps: float, rngs: nnx.Rngs, dtype: jnp.dtype,
               param_dtype: jnp.dtype, logical_axis: str = "norm", cast_before_scale: bool = True,
               use_scale: bool = True):
    self.scale = param(rngs, (dim,), (logical_axis,), std=None, dtype=param_dtype) if use_scale else None
    self.eps = eps
    self.dtype = dtype
    self.cast_before_scale = cast_before_scale

  def __call__(self, x: jax.Array) -> jax.Array:
    y = rms_normalize(x, self.eps)
    if self.scale is None:
      return y.astype(self.dtype)
    if self.cast_before_scale:
      return y.astype(self.dtype) * self.scale[...].astype(self.dtype)
    return (y * self.scale[...].astype(jnp.float32)).astype(self.dtype)
