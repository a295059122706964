"""Context parallelism for flash attention: the sequence split over the mesh's context axis
(`ici/dcn_context_parallelism`), each shard holding two chunks of C = S / (2n) tokens.

Layouts. The natural layout gives shard i chunks (2i, 2i+1); under a causal mask its last shard then
does most of the work. The load-balanced layout (`balanced_layout`, set by the loss around the model
while the batch is in `to_balanced` order) gives shard i chunks (i, 2n-1-i): an early and a late one,
so every shard sees about the same number of (query, key) pairs. Only the token order changes; the
positions and segment ids travel with the tokens, so the masks and RoPE see true positions, and a
loss summed over tokens is unchanged. Attention reads the layout from `chunk_table`.

Strategies (`context_parallel_strategy`):
- all_gather: K/V (and their segment ids) gathered over the axis and put back in sequence order;
  each of the shard's two query chunks attends to them in one kernel call whose `offsets` give the
  chunk's first position. Autodiff through the gather (its transpose is a reduce-scatter) and the
  kernel's own VJP.
- ring: K/V blocks passed around the axis with `ppermute` (the next block's transfer is issued
  before the current block's compute), each (query chunk, key chunk) pair one `flash_block_forward`
  call whose (o, lse) merge online; the backward (a custom VJP) passes K/V around again with their
  dK/dV accumulators, which arrive home after n steps, and uses the merged lse. The merged o and
  lse are named "flash_out" / "flash_lse" as the flash kernel's are, so a remat policy that keeps
  those (`save_matmuls`) does not run the ring's forward again in the backward pass.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from MaxText.kernels.flash_attention import (flash_attention, flash_block_backward,
                                             flash_block_forward)
from MaxText.kernels.flash_common import MASK_VALUE
from MaxText.sharding.rules import ShardingContext, logical_to_spec

STRATEGIES = ("all_gather", "ring")
_BALANCED: contextvars.ContextVar[bool] = contextvars.ContextVar("cp_balanced", default=False)


@contextlib.contextmanager
def balanced_layout(on: bool = True):
  """Inside: the model's token arrays are in `to_balanced` order (set by who permuted them)."""
  token = _BALANCED.set(on)
  try:
    yield
  finally:
    _BALANCED.reset(token)


def is_balanced() -> bool:
  return _BALANCED.get()


def chunk_table(n: int, balanced: bool) -> tuple[tuple[int, int], ...]:
  """The two chunk indices (of 2n) each of the n shards holds, in the order it holds them."""
  if balanced:
    return tuple((i, 2 * n - 1 - i) for i in range(n))
  return tuple((2 * i, 2 * i + 1) for i in range(n))


def balance_order(S: int, n: int) -> np.ndarray:
  """Token indices of the load-balanced order: position p of the balanced row holds token
  order[p] of the natural row."""
  C = S // (2 * n)
  chunks = [c for pair in chunk_table(n, True) for c in pair]
  return np.concatenate([np.arange(c * C, (c + 1) * C) for c in chunks])


def to_balanced(x, n: int, axis: int = 1):
  """A token array (sequence along `axis`) in the load-balanced order."""
  return jnp.take(x, jnp.asarray(balance_order(x.shape[axis], n)), axis=axis)


def from_balanced(x, n: int, axis: int = 1):
  """The inverse of `to_balanced` (e.g. per-token outputs back in sequence order)."""
  return jnp.take(x, jnp.asarray(np.argsort(balance_order(x.shape[axis], n))), axis=axis)


def length_axes(ctx: ShardingContext, B: int, S: int) -> tuple[str, ...]:
  """The mesh axes (of size > 1) the sequence of a [B, S] token array is split over."""
  spec = logical_to_spec(("activation_batch", "activation_length"), (B, S), ctx.rules, ctx.mesh)
  length = spec[1]
  length = () if length is None else (length,) if isinstance(length, str) else tuple(length)
  return tuple(a for a in length if ctx.mesh.shape[a] > 1)


def context_size(ctx: ShardingContext | None, B: int, S: int) -> int:
  """How many shards the sequence of a [B, S] token batch is split into under `ctx` (1: none)."""
  if ctx is None:
    return 1
  return math.prod(ctx.mesh.shape[a] for a in length_axes(ctx, B, S))


# ----------------------------------------------------------------------------- all_gather
def _natural_order(x, table, axes):
  """[b, 2C, ...] per shard → all shards' chunks gathered [b, S, ...] in sequence order."""
  n = len(table)
  g = lax.all_gather(x, axes, axis=1, tiled=True)                  # shard order: table flattened
  b, S = g.shape[:2]
  held = [c for pair in table for c in pair]
  inverse = np.argsort(np.asarray(held))
  g = g.reshape(b, 2 * n, S // (2 * n), *g.shape[2:])[:, inverse]
  return g.reshape(b, S, *g.shape[3:])


def _all_gather(q, k, v, seg, *, axes, table, kw):
  C = q.shape[1] // 2
  mine = jnp.asarray(table)[lax.axis_index(axes)]
  k_all, v_all, kseg = (_natural_order(x, table, axes) for x in (k, v, seg))
  outs = []
  for a in range(2):
    rows = slice(a * C, (a + 1) * C)
    offsets = jnp.stack([mine[a] * C, jnp.int32(0)]).astype(jnp.int32)
    outs.append(flash_attention(q[:, rows], k_all, v_all, seg[:, rows], kv_segment_ids_BT=kseg,
                                offsets=offsets, **dict(kw)))
  return jnp.concatenate(outs, axis=1)


# ----------------------------------------------------------------------------- ring
def _ring_perm(n: int):
  return [(j, (j + 1) % n) for j in range(n)]


def _pair_offsets(qc, kc, C):
  return jnp.stack([qc * C, kc * C]).astype(jnp.int32)


def _ring_forward(q, k, v, seg, axes, table, kw):
  """(o [b,2C,h,E] in q's dtype, lse [b,h,2C] fp32, 0 for rows that see no key)."""
  n, C = len(table), q.shape[1] // 2
  tab = jnp.asarray(table)
  i = lax.axis_index(axes)
  qs = [q[:, a * C:(a + 1) * C] for a in range(2)]
  segs = [seg[:, a * C:(a + 1) * C] for a in range(2)]
  b, _, h, e = q.shape

  def step(carry, s):
    k, v, kseg, accs = carry
    nxt = lax.ppermute((k, v, kseg), axes, _ring_perm(n))         # in flight during the compute
    kc = tab[(i - s) % n]
    new = []
    for a in range(2):
      o_acc, l_acc = accs[a]
      for bb in range(2):
        rows = slice(bb * C, (bb + 1) * C)
        o, lse = flash_block_forward(qs[a], k[:, rows], v[:, rows], segs[a], kseg[:, rows],
                                     _pair_offsets(tab[i][a], kc[bb], C), **dict(kw))
        m = jnp.maximum(l_acc, lse)
        w_acc, w = jnp.exp(l_acc - m), jnp.exp(lse - m)
        l_new = m + jnp.log(w_acc + w)
        scale = lambda x: jnp.swapaxes(x, 1, 2)[..., None]          # [b,h,C] → [b,C,h,1]
        o_acc = o_acc * scale(jnp.exp(l_acc - l_new)) + o.astype(jnp.float32) * scale(
            jnp.exp(lse - l_new))
        l_acc = l_new
      new.append((o_acc, l_acc))
    return (*nxt, tuple(new)), None

  init = tuple((jnp.zeros((b, C, h, e), jnp.float32), jnp.full((b, h, C), MASK_VALUE, jnp.float32))
               for _ in range(2))
  (_, _, _, accs), _ = lax.scan(step, (k, v, seg, init), jnp.arange(n))
  o = jnp.concatenate([accs[0][0], accs[1][0]], axis=1).astype(q.dtype)
  lse = jnp.concatenate([accs[0][1], accs[1][1]], axis=2)
  return o, jnp.where(lse < 0.5 * MASK_VALUE, 0.0, lse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _ring(q, k, v, seg, axes, table, kw):
  return _ring_forward(q, k, v, seg, axes, table, kw)[0]


def _ring_fwd(q, k, v, seg, axes, table, kw):
  o, lse = _ring_forward(q, k, v, seg, axes, table, kw)
  o, lse = checkpoint_name(o, "flash_out"), checkpoint_name(lse, "flash_lse")
  return o, (q, k, v, seg, o, lse)


def _ring_bwd(axes, table, kw, res, do):
  q, k, v, seg, o, lse = res
  n, C = len(table), q.shape[1] // 2
  tab = jnp.asarray(table)
  i = lax.axis_index(axes)
  part = lambda x, a, ax=1: lax.slice_in_dim(x, a * C, (a + 1) * C, axis=ax)

  def step(carry, s):
    k, v, kseg, dk, dv, dq = carry
    kc = tab[(i - s) % n]
    dq, dk_parts, dv_parts = list(dq), [], []
    for bb in range(2):
      dk_b, dv_b = part(dk, bb), part(dv, bb)
      for a in range(2):
        gq, gk, gv = flash_block_backward(
            part(q, a), part(k, bb), part(v, bb), part(seg, a), part(kseg, bb),
            _pair_offsets(tab[i][a], kc[bb], C), part(o, a), part(lse, a, 2), part(do, a),
            **dict(kw))
        dq[a] = dq[a] + gq.astype(jnp.float32)
        dk_b, dv_b = dk_b + gk.astype(jnp.float32), dv_b + gv.astype(jnp.float32)
      dk_parts.append(dk_b)
      dv_parts.append(dv_b)
    dk, dv = jnp.concatenate(dk_parts, axis=1), jnp.concatenate(dv_parts, axis=1)
    k, v, kseg, dk, dv = lax.ppermute((k, v, kseg, dk, dv), axes, _ring_perm(n))
    return (k, v, kseg, dk, dv, tuple(dq)), None

  zq = jnp.zeros((q.shape[0], C, *q.shape[2:]), jnp.float32)
  init = (k, v, seg, jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32), (zq, zq))
  (_, _, _, dk, dv, dq), _ = lax.scan(step, init, jnp.arange(n))
  return (jnp.concatenate(dq, axis=1).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
          None)


_ring.defvjp(_ring_fwd, _ring_bwd)


# ----------------------------------------------------------------------------- entry
def flash_context_parallel(q_BSHE, k_BTKE, v_BTKE, segment_ids_BS, *, ctx: ShardingContext,
                           strategy: str, batch, heads, kv_heads, **kernel_kw) -> jax.Array:
  """Flash attention of a sequence split over the context axis (`length_axes`), by `strategy`;
  `batch` / `heads` / `kv_heads`: the mesh axes (or None) of those dimensions, as `_per_shard`
  chose them. `kernel_kw`: scale, causal, sliding_window, block_q, block_kv."""
  if strategy not in STRATEGIES:
    raise ValueError(f"context_parallel_strategy={strategy!r}: expected one of {STRATEGIES}")
  B, S = q_BSHE.shape[:2]
  axes = length_axes(ctx, B, S)
  n = math.prod(ctx.mesh.shape[a] for a in axes)
  if S % (2 * n):
    raise ValueError(f"context parallelism over {n} shards needs the sequence length ({S}) to be "
                     f"a multiple of {2 * n} (two chunks per shard)")
  if segment_ids_BS is None:
    segment_ids_BS = jnp.ones((B, S), jnp.int32)
  table = chunk_table(n, is_balanced())
  kw = tuple(sorted(kernel_kw.items()))
  length = axes[0] if len(axes) == 1 else axes
  if strategy == "all_gather":
    body = functools.partial(_all_gather, axes=length, table=table, kw=kw)
  else:
    body = lambda q, k, v, seg: _ring(q, k, v, seg, length, table, kw)
  q_spec, kv_spec = P(batch, length, heads, None), P(batch, length, kv_heads, None)
  return jax.shard_map(body, mesh=ctx.mesh, in_specs=(q_spec, kv_spec, kv_spec, P(batch, length)),
                       out_specs=q_spec, check_vma=False)(
                           q_BSHE, k_BTKE, v_BTKE, segment_ids_BS.astype(jnp.int32))
