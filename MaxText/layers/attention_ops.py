"""Attention kernels behind the `attention` key. All take q[B,S,H,E], k/v[B,T,K,E] with H % K == 0
(GQA without repeating K/V), segment ids [B,S] (0 = padding) and return [B,S,H,E]."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def dot_product_attention(q_BSHE, k_BTKE, v_BTKE, segment_ids_BS, *, scale: float,
                          causal: bool = True) -> jax.Array:
  """Materialises the [S,T] scores: softmax in fp32, masks for causality and packed documents."""
  B, S, H, E = q_BSHE.shape
  K = k_BTKE.shape[2]
  q_BSKGE = q_BSHE.reshape(B, S, K, H // K, E)
  scores = jnp.einsum("bskge,btke->bkgst", q_BSKGE, k_BTKE,
                      preferred_element_type=jnp.float32) * scale
  mask_BST = segment_ids_BS[:, :, None] == segment_ids_BS[:, None, :]
  if causal:
    mask_BST &= jnp.tril(jnp.ones((S, S), jnp.bool_))[None]
  scores = jnp.where(mask_BST[:, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v_BTKE.dtype)
  out = jnp.einsum("bkgst,btke->bskge", probs, v_BTKE)
  return out.reshape(B, S, H, E)


ATTENTION_OPS = {"dot_product": dot_product_attention}
