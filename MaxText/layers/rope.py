"""Rotary position embedding, "rotate half" layout (the Hugging Face Llama/Qwen/Gemma convention).

Channel i < E/2 is paired with channel i + E/2 and rotated by angle position × θ^(-2i/E).
Positions come from the data (they restart at 0 for each packed document).

`fraction` < 1 is Gemma 4's "proportional" partial RoPE: only the first `int(fraction·E // 2)` pairs
rotate (channels [0, ra) and [E/2, E/2 + ra)), with the exponent's denominator still the FULL E; the
other pairs have frequency 0 (identity).

`apply_partial_rope` is the other partial convention (Hugging Face's `partial_rotary_factor`,
e.g. Qwen3-Next): the first `rotary_dim` channels rotate as a head of that width (pairs i,
i + rotary_dim/2, exponent denominator rotary_dim); the others pass through unchanged.

Cast order as Hugging Face: angles in fp32, cos/sin cast to the activation dtype, the rotation done
in the activation dtype.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from MaxText.backend import hot_path


def inverse_frequencies(head_dim: int, theta: float, fraction: float = 1.0) -> jax.Array:
  E = head_dim
  inv_freq = 1.0 / theta ** (jnp.arange(0, E, 2, dtype=jnp.float32) / E)   # [E/2], as HF computes it
  if fraction < 1.0:
    rotated = int(fraction * E // 2)
    inv_freq = jnp.where(jnp.arange(E // 2) < rotated, inv_freq, 0.0)
  return inv_freq


def apply_rope(x_BSHE: jax.Array, positions_BS: jax.Array, theta: float,
               fraction: float = 1.0) -> jax.Array:
  E = x_BSHE.shape[-1]
  inv_freq = inverse_frequencies(E, theta, fraction)
  angle_BSE2 = positions_BS.astype(jnp.float32)[..., None] * inv_freq       # [B,S,E/2]
  dtype = x_BSHE.dtype
  sin = jnp.sin(angle_BSE2)[:, :, None, :].astype(dtype)
  cos = jnp.cos(angle_BSE2)[:, :, None, :].astype(dtype)
  if hot_path.tuned():
    return _rotate(x_BSHE, cos, sin)
  return rotate_by_swap_matmul(x_BSHE, cos, sin)


def swap_halves_matrix(E: int, dtype) -> jax.Array:
  """[E, E] 0/1 matrix P with (x @ P)[..., j] = x[..., (j + E/2) mod E]: the halves swapped."""
  return jnp.roll(jnp.eye(E, dtype=dtype), E // 2, axis=0)


def rotate_by_swap_matmul(x, cos, sin):
  """The rotation of `_rotate_by` as x·[cos, cos] + (x @ P)·[−sin, sin], P swapping the halves
  (`swap_halves_matrix`): the same products and sums, so the same bits (x @ P is exact: one
  nonzero term per output, f32 accumulation; at `highest` for fp32 inputs). On TPU the swap is one
  small MXU matmul whose output fusion takes the rotation, the scale and the heads-major layout
  splash reads, where slicing the 128-lane head dimension into halves made XLA write them as two
  half-filled arrays and concatenate them in a second pass (a v5e, Qwen3-0.6B at seq 2048 batch
  8: the step 693 -> 663 ms, RESULTS.md "TPU v5e")."""
  E = x.shape[-1]
  precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
  swapped = jnp.einsum("...e,ef->...f", x, swap_halves_matrix(E, x.dtype), precision=precision,
                       preferred_element_type=jnp.float32).astype(x.dtype)
  cos2 = jnp.concatenate([cos, cos], axis=-1)
  sin2 = jnp.concatenate([-sin, sin], axis=-1)
  return x * cos2 + swapped * sin2


def _rotate_by(x, cos, sin):
  """(x1, x2) → (x1·cos − x2·sin, x2·cos + x1·sin) over the two halves of the last axis."""
  E = x.shape[-1]
  x1, x2 = x[..., : E // 2], x[..., E // 2:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


@jax.custom_vjp
def _rotate(x, cos, sin):
  return _rotate_by(x, cos, sin)


def _rotate_fwd(x, cos, sin):
  return _rotate_by(x, cos, sin), (cos, sin)


def _rotate_bwd(res, g):
  """The transpose of the rotation is the rotation by the opposite angle: the same products and
  sums autodiff forms (bit for bit, in any dtype), without its slices padded back and added."""
  cos, sin = res
  return _rotate_by(g, cos, -sin), jnp.zeros_like(cos), jnp.zeros_like(sin)


_rotate.defvjp(_rotate_fwd, _rotate_bwd)


def apply_partial_rope(x_BSHE: jax.Array, positions_BS: jax.Array, theta: float,
                       rotary_dim: int) -> jax.Array:
  E = x_BSHE.shape[-1]
  if rotary_dim == E:
    return apply_rope(x_BSHE, positions_BS, theta)
  rotated = apply_rope(x_BSHE[..., :rotary_dim], positions_BS, theta)
  return jnp.concatenate([rotated, x_BSHE[..., rotary_dim:]], axis=-1)
