"""Attention kernels behind the `attention` key. All take q[B,S,H,E], k/v[B,T,K,E] with H % K == 0
(GQA without repeating K/V), segment ids [B,S] (0 = padding) and return [B,S,H,E]."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def dot_product_attention(q_BSHE, k_BTKE, v_BTKE, segment_ids_BS, *, scale: float,
                          causal: bool = True, sliding_window: int | None = None) -> jax.Array:
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
  if sliding_window is not None:                                # keys q - W < k (<= q if causal)
    mask_BST &= (jnp.arange(T)[None, :] > jnp.arange(S)[:, None] - sliding_window)[None]
  mask_BQT = jnp.tile(mask_BST, (1, G, 1))                      # row g*S + s ↔ (head g, query s)
  scores_BKQT = jnp.where(mask_BQT[:, None], scores_BKQT, jnp.finfo(jnp.float32).min)
  probs_BKQT = jax.nn.softmax(scores_BKQT, axis=-1).astype(v_BTKE.dtype)
  out_BKQE = jnp.einsum("bkqt,bkte->bkqe", probs_BKQT, v_BKTE)
  return out_BKQE.reshape(B, K, G, S, E).transpose(0, 3, 1, 2, 4).reshape(B, S, H, E)


def flash(q_BSHE, k_BTKE, v_BTKE, segment_ids_BS, *, scale: float, causal: bool = True,
          sliding_window: int | None = None, block_q: int = 512, block_kv: int = 512) -> jax.Array:
  """Our Pallas flash-attention kernel (MaxText/kernels). Under a mesh (`use_rules`) it runs per
  shard through `shard_map`: batch over the `activation_batch` axes, heads over the
  `activation_heads` axes when the kv heads split the same way (else heads stay whole); the
  sequence is not split (context parallelism needs a ring schedule, not provided here)."""
  from MaxText.kernels import flash_attention
  from MaxText.sharding.rules import current_context, logical_to_spec

  def run(q, k, v, seg):
    return flash_attention(q, k, v, seg, scale=scale, causal=causal, sliding_window=sliding_window,
                           block_q=block_q, block_kv=block_kv)

  ctx = current_context()
  if ctx is None:
    return run(q_BSHE, k_BTKE, v_BTKE, segment_ids_BS)
  B, S, H, _ = q_BSHE.shape
  K = k_BTKE.shape[2]
  spec = lambda names, shape: logical_to_spec(names, shape, ctx.rules, ctx.mesh)
  batch = spec(("activation_batch",), (B,))[0]
  heads, kv_heads = spec((None, "activation_heads"), (B, H))[1], spec((None, "activation_kv_heads"), (B, K))[1]
  if heads != kv_heads:
    heads = kv_heads = None
  length = spec(("activation_batch", "activation_length"), (B, S))[1]
  length = () if length is None else (length,) if isinstance(length, str) else length
  if any(ctx.mesh.shape[a] > 1 for a in length):
    raise ValueError("attention=flash does not support a sharded sequence (context parallelism)")
  q_spec, kv_spec = P(batch, None, heads, None), P(batch, None, kv_heads, None)
  return jax.shard_map(run, mesh=ctx.mesh, in_specs=(q_spec, kv_spec, kv_spec, P(batch, None)),
                       out_specs=q_spec, check_vma=False)(q_BSHE, k_BTKE, v_BTKE, segment_ids_BS)


ATTENTION_OPS = {"dot_product": dot_product_attention, "flash": flash}


def select_attention(name: str, platform: str) -> str:
  """`autoselected` → flash on GPUs, the XLA dot-product path elsewhere (on CPU the kernel only
  runs in the slow Pallas interpreter; TPU splash attention is not wired up yet)."""
  if name != "autoselected":
    return name
  return "flash" if platform in ("gpu", "cuda", "rocm") else "dot_product"
