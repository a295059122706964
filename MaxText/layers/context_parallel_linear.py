"""Context parallelism for the recurrent layers (the causal conv and the gated delta rule of a linear
-attention layer): the sequence split over the context axis in the two-chunks-per-shard layout of
`context_parallel.chunk_table` (natural or load-balanced), exact.

- The conv: each chunk is run with the last W-1 inputs (and segment ids) of the chunk before it in
  the sequence prepended, so the window crosses chunk and shard boundaries as it would in one row
  (and still restarts at a document start). Written on the global arrays: the tails move between
  shards by the partitioner, W-1 tokens a chunk.
- The reset flags (a document's first token) compare each chunk's first segment id with the last
  one of the chunk before it in the sequence, so a document that crosses shards does not restart.
- The gated delta rule (`shard_map` over the context axis): a scan over the 2n chunks in sequence
  order; at step t the shard holding chunk t runs the chunked rule on it from the incoming state,
  and its final state is handed to every shard (a `psum` of the owner's state). Every shard runs the
  step's program (its result kept only by the owner), so the rule's compute per shard is that of a
  whole sequence while its memory is that of its own part.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from MaxText.layers.causal_conv import causal_conv
from MaxText.layers.context_parallel import chunk_table, is_balanced, length_axes
from MaxText.layers.gated_delta import chunked_gated_delta_rule, document_starts
from MaxText.sharding.rules import ShardingContext, logical_to_spec


def _held(table) -> list[int]:
  return [c for pair in table for c in pair]


def _predecessor_slots(table) -> list[int]:
  """For each slot p of the layout (shard-major), the slot holding the chunk before chunk[p] in
  the sequence; 2n (a fill slot) for the first chunk."""
  held = _held(table)
  where = {c: p for p, c in enumerate(held)}
  return [where.get(c - 1, len(held)) for c in held]


def _chunks(x, n: int):
  """[B, S, ...] → [B, 2n, S / 2n, ...] (slots of the layout)."""
  return x.reshape(x.shape[0], 2 * n, x.shape[1] // (2 * n), *x.shape[2:])


def _previous_tails(x_BPC_, width: int, table, fill):
  """The last `width` entries of the chunk before each slot's chunk: [B, 2n, width, ...]."""
  tails = x_BPC_[:, :, x_BPC_.shape[2] - width:]
  filled = jnp.concatenate([tails, jnp.full_like(tails[:, :1], fill)], axis=1)
  return filled[:, jnp.asarray(_predecessor_slots(table))]


def conv_over_chunks(x_BS_, w_W_, segment_ids_BS, n: int) -> jax.Array:
  """`causal_conv` of a row in the two-chunks-per-shard layout over n shards (fp32 [B, S, ...])."""
  table = chunk_table(n, is_balanced())
  B, S = segment_ids_BS.shape
  W = w_W_.shape[0]
  if W == 1:
    return causal_conv(x_BS_, w_W_, document_starts(segment_ids_BS))
  xc, sc = _chunks(x_BS_, n), _chunks(segment_ids_BS, n)
  if xc.shape[2] < W - 1:
    raise ValueError(f"context parallelism: chunks of {xc.shape[2]} tokens are shorter than the "
                     f"conv window ({W - 1} previous tokens)")
  ext = jnp.concatenate([_previous_tails(xc, W - 1, table, 0), xc], axis=2)
  ext_seg = jnp.concatenate([_previous_tails(sc, W - 1, table, -1), sc], axis=2)
  L = ext.shape[2]
  out = causal_conv(ext.reshape(B * 2 * n, L, *ext.shape[3:]), w_W_,
                    document_starts(ext_seg.reshape(B * 2 * n, L)))
  return out.reshape(B, 2 * n, L, *out.shape[2:])[:, :, W - 1:].reshape(B, S, *out.shape[2:])


def resets_over_chunks(segment_ids_BS, n: int) -> jax.Array:
  """`document_starts` of a row in the two-chunks-per-shard layout over n shards."""
  table = chunk_table(n, is_balanced())
  B, S = segment_ids_BS.shape
  sc = _chunks(segment_ids_BS, n)
  before = _previous_tails(sc, 1, table, -1)[:, :, 0]
  first = (sc[:, :, 0] != before)[:, :, None]
  return jnp.concatenate([first, sc[:, :, 1:] != sc[:, :, :-1]], axis=2).reshape(B, S)


def _rule_body(q, k, v, g, beta, reset, *, axes, table, chunk_size):
  n = len(table)
  C = q.shape[1] // 2
  i = lax.axis_index(axes)
  owners = [(shard, slot) for c in range(2 * n) for shard, pair in enumerate(table)
            for slot, held in enumerate(pair) if held == c]
  owner_shard = jnp.asarray([s for s, _ in owners], jnp.int32)
  owner_slot = jnp.asarray([s for _, s in owners], jnp.int32)
  b, _, h, _ = q.shape

  def step(carry, t):
    state, out = carry
    start = owner_slot[t] * C
    part = lambda x: lax.dynamic_slice_in_dim(x, start, C, axis=1)
    o, new = chunked_gated_delta_rule(part(q), part(k), part(v), part(g), part(beta), part(reset),
                                      chunk_size=chunk_size, initial_state_BHKV=state)
    mine = i == owner_shard[t]
    out = lax.dynamic_update_slice_in_dim(out, jnp.where(mine, o, part(out)), start, axis=1)
    state = lax.psum(jnp.where(mine, new, 0.0), axes)
    return (state, out), None

  state = jnp.zeros((b, h, q.shape[-1], v.shape[-1]), jnp.float32)
  out = jnp.zeros((b, 2 * C, h, v.shape[-1]), jnp.float32)
  (_, out), _ = lax.scan(step, (state, out), jnp.arange(2 * n))
  return out


def gated_delta_over_chunks(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, reset_BS, *,
                            ctx: ShardingContext, chunk_size: int) -> jax.Array:
  """The chunked gated delta rule of rows split over the context axis (`reset_BS`:
  `resets_over_chunks`); o [B, S, H, V] fp32."""
  B, S, H, _ = q_BSHK.shape
  axes = length_axes(ctx, B, S)
  n = math.prod(ctx.mesh.shape[a] for a in axes)
  spec = logical_to_spec(("activation_batch", "activation_length", "activation_heads"), (B, S, H),
                         ctx.rules, ctx.mesh)
  batch, heads = spec[0], spec[2]
  length = axes[0] if len(axes) == 1 else axes
  x_spec, g_spec = P(batch, length, heads, None), P(batch, length, heads)
  body = functools.partial(_rule_body, axes=length, table=chunk_table(n, is_balanced()),
                           chunk_size=chunk_size)
  return jax.shard_map(body, mesh=ctx.mesh,
                       in_specs=(x_spec, x_spec, x_spec, g_spec, g_spec, P(batch, length)),
                       out_specs=x_spec, check_vma=False)(
                           q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, reset_BS)
