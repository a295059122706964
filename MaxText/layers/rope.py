"""Rotary position embedding, "rotate half" layout (the Hugging Face Llama/Qwen convention).

Channel i < E/2 is paired with channel i + E/2 and rotated by angle position × θ^(-2i/E).
Positions come from the data (they restart at 0 for each packed document).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def apply_rope(x_BSHE: jax.Array, positions_BS: jax.Array, theta: float) -> jax.Array:
  E = x_BSHE.shape[-1]
  inv_freq = 1.0 / theta ** (jnp.arange(0, E, 2, dtype=jnp.float32) / E)   # [E/2], as HF computes it
  angle_BSE2 = positions_BS.astype(jnp.float32)[..., None] * inv_freq       # [B,S,E/2]
  sin, cos = jnp.sin(angle_BSE2)[:, :, None, :], jnp.cos(angle_BSE2)[:, :, None, :]
  x = x_BSHE.astype(jnp.float32)
  x1, x2 = x[..., : E // 2], x[..., E // 2:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BSHE.dtype)
