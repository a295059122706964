"""RMSNorm in the two cast orders the supported families use (identical in fp32, not in bf16):

  cast_before_scale=True   Llama / Qwen3: normalise in fp32, cast to the compute dtype, then multiply
                           by the scale (in the compute dtype).
  cast_before_scale=False  Gemma 4: normalise and multiply by the fp32 scale, cast once at the end.

`use_scale=False` is the scale-free variant (Gemma 4's v_norm and router norm). The scale is plain
`w` (initialised to 1), or with `zero_centered=True` `1 + w` (w initialised to 0: Qwen3-Next).

With a scale, on the XLA:CPU-tuned hot path (`MaxText/backend/hot_path.py`), the norm has a
hand-written VJP (`scaled_rms_norm`): the scale's gradient is one matvec over the tokens, and
autodiff's gradients otherwise (bf16: the scale's gradient is no longer rounded to bf16 before its
fp32 cast). On the plain path (GPU, TPU) autodiff differentiates the same forward.

`GatedRMSNorm` is the output norm of Gated DeltaNet layers: rms(x) · w · silu(z) over the last axis.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from MaxText.backend import hot_path
from MaxText.layers.linear import param


def _inv_rms(x32: jax.Array, eps: float) -> jax.Array:
  """1 / sqrt(mean(x^2) + eps) over the last axis of fp32 x (kept as [..., 1])."""
  return jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
  """x / sqrt(mean(x^2) + eps) over the last axis, in fp32."""
  x32 = x.astype(jnp.float32)
  return x32 * _inv_rms(x32, eps)


def _scaled(x, scale, eps, dtype, cast_before_scale):
  """(the normalised x in `dtype` times the fp32 `scale`, in the cast order), fp32 x̂, 1/rms."""
  x32 = x.astype(jnp.float32)
  inv_rms = _inv_rms(x32, eps)
  x_hat = x32 * inv_rms
  if cast_before_scale:
    return x_hat.astype(dtype) * scale.astype(dtype), x_hat, inv_rms
  return (x_hat * scale).astype(dtype), x_hat, inv_rms


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def scaled_rms_norm(x, scale32, eps: float, dtype, cast_before_scale: bool):
  """RMSNorm with an fp32 scale [D] (see the module doc for the cast orders), differentiated by
  hand: the scale's gradient is one matvec ones[T] @ (g · x̂)[T, D] with fp32 accumulation, where
  autodiff's reduction over all token axes becomes slow `reduce-window`s on XLA:CPU."""
  return _scaled(x, scale32, eps, dtype, cast_before_scale)[0]


def _scaled_fwd(x, scale32, eps, dtype, cast_before_scale):
  y, _, inv_rms = _scaled(x, scale32, eps, dtype, cast_before_scale)
  return y, (x, scale32, inv_rms)


def _scaled_bwd(eps, dtype, cast_before_scale, res, g):
  x, scale32, inv_rms = res
  x_hat = x.astype(jnp.float32) * inv_rms
  if cast_before_scale:   # y = x̂_c · s_c in `dtype` (as autodiff: both products in that dtype)
    dx_hat = (g * scale32.astype(dtype)).astype(jnp.float32)
    gx = g * x_hat.astype(dtype)
  else:                   # y = (x̂ · s) cast once
    g32 = g.astype(jnp.float32)
    dx_hat, gx = g32 * scale32, g32 * x_hat
  gx_TD = gx.reshape(-1, gx.shape[-1])
  dscale = jax.lax.dot_general(jnp.ones((gx_TD.shape[0],), gx_TD.dtype), gx_TD,
                               (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
  dx = inv_rms * (dx_hat - x_hat * jnp.mean(dx_hat * x_hat, axis=-1, keepdims=True))
  return dx.astype(x.dtype), dscale


scaled_rms_norm.defvjp(_scaled_fwd, _scaled_bwd)


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
    if self.scale is None:
      return rms_normalize(x, self.eps).astype(self.dtype)
    scale = self.scale[...].astype(jnp.float32)
    if self.zero_centered:
      scale = 1.0 + scale
    if not hot_path.tuned():
      return _scaled(x, scale, self.eps, jnp.dtype(self.dtype), self.cast_before_scale)[0]
    return scaled_rms_norm(x, scale, self.eps, jnp.dtype(self.dtype), self.cast_before_scale)


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
