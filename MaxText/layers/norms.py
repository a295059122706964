"""RMSNorm in the two cast orders the supported families use (identical in fp32, not in bf16):

  cast_before_scale=True   Llama / Qwen3: normalise in fp32, cast to the compute dtype, then multiply
                           by the scale (in the compute dtype).
  cast_before_scale=False  Gemma 4: normalise and multiply by the fp32 scale, cast once at the end.

`use_scale=False` is the scale-free variant (Gemma 4's v_norm and router norm). The scale is plain
`w` (initialised to 1), or with `zero_centered=True` `1 + w` (w initialised to 0: Qwen3-Next).

`GatedRMSNorm` is the output norm of Gated DeltaNet layers: rms(x) · w · silu(z) over the last axis.
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
               use_scale: bool = True, zero_centered: bool = False):
    if not use_scale:
      self.scale = None
    elif zero_centered:
      self.scale = nnx.Param(jnp.zeros((dim,), param_dtype), logical_axes=(logical_axis,))
    else:
      self.scale = param(rngs, (dim,), (logical_axis,), std=None, dtype=param_dtype)
    self.zero_centered = zero_centered
    self.eps = eps
    self.dtype = dtype
    self.cast_before_scale = cast_before_scale

  def __call__(self, x: jax.Array) -> jax.Array:
    y = rms_normalize(x, self.eps)
    if self.scale is None:
      return y.astype(self.dtype)
    scale = self.scale[...].astype(jnp.float32)
    if self.zero_centered:
      scale = 1.0 + scale
    if self.cast_before_scale:
      return y.astype(self.dtype) * scale.astype(self.dtype)
    return (y * scale).astype(self.dtype)


class GatedRMSNorm(nnx.Module):
  """rms(x) · w · silu(z) (w initialised to 1), Hugging Face's cast order: normalise in fp32, cast
  to the compute dtype, times w, then times silu(z) in fp32, cast once at the end."""

  def __init__(self, dim: int, *, eps: float, rngs: nnx.Rngs, dtype: jnp.dtype,
               param_dtype: jnp.dtype, logical_axis: str = "norm"):
    self.scale = param(rngs, (dim,), (logical_axis,), std=None, dtype=param_dtype)
    self.eps = eps
    self.dtype = dtype

  def __call__(self, x: jax.Array, z: jax.Array) -> jax.Array:
    y = rms_normalize(x, self.eps).astype(self.dtype) * self.scale[...].astype(self.dtype)
    return (y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(self.dtype)
