"""Attention kernels behind the `attention` key. All take q[B,S,H,E], k/v[B,T,K,E] with H % K == 0
(GQA without repeating K/V), segment ids [B,S] (0 = padding) and return [B,S,H,E]."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def dot_product_attention(q_BSHE, k_BTKE, v_BTKE, segment_ids_BS, *, scale: float,
                          causal: bool = True) -> jax.Array:
  """Materialises the scores: softmax in fp32, masks for causality and packed documents.

  Heads-major layout: the G = H/K query heads that share one kv head are folded into the query
  length (Q = G·S rows per kv head), so both matmuls are plain batched [Q,E]x[E,T] products over
  (B, K) — the layout XLA handles best, and K/V are never repeated.
  """
  B, S, H, E = q_BSHE.shape
  T, K = k_BTKE.shape[1], k_BTKE.shape[2]
  G = H // K
  q_BKQE = q_BSHE.reshape(B, S, K, G, E).transpose(0, 2, 3, 1, 4).reshape(B, K, G * S, E)
  k_BKTE, v_BKTE = k_BTKE.transpose(0, 2, 1, 3), v_BTKE.transpose(0, 2, 1, 3)
  scores_BKQT = jnp.einsum("bkqe,bkte->bkqt", q_BKQE, k_BKTE,
                           preferred_element_type=jnp.float32) * scale
  mask_BST = segment_ids_BS[:, :, None] == segment_ids_BS[:, None, :]
  if causal:
    mask_BST &= jnp.tril(jnp.ones((S, T), jnp.bool_))[None]
  mask_BQT = jnp.tile(mask_BST, (1, G, 1))                      # row g*S + s ↔ (head g, query s)
  scores_BKQT = jnp.where(mask_BQT[:, None], scores_BKQT, jnp.finfo(jnp.float32).min)
  probs_BKQT = jax.nn.softmax(scores_BKQT, axis=-1).astype(v_BTKE.dtype)
  out_BKQE = jnp.einsum("bkqt,bkte->bkqe", probs_BKQT, v_BKTE)
  return out_BKQE.reshape(B, K, G, S, E).transpose(0, 3, 1, 2, 4).reshape(B, S, H, E)


ATTENTION_OPS = {"dot_product": dot_product_attention}
