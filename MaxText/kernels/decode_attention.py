"""`decode_attention=pallas`: one decoding step's attention over a full-attention KV cache as a
Pallas TPU kernel (flash decoding: an online softmax over blocks of cache positions) that reads
only the blocks holding live positions.

Why: a decoding step is memory-bound, its cache read grows with the batch (Qwen3-0.6B at batch 32
and a 256-position bucket reads 896 MiB of K/V a step, about what it reads of weights), and the
XLA einsums read the whole bucket whatever each row's length. Here a row block's cache blocks
beyond its longest live row are not fetched at all: the block index is clamped to the last live
block, and Pallas does not copy a block whose index did not change.

Layouts (MaxText/layers/kv_cache.py): the stacked cache of one group, k / v [L, B, K, T, E], is
seen as [L·B·K, T, E] (a reshape, no copy) and the kernel is handed the WHOLE stack with the layer
in a scalar operand, so cutting the layer's row costs no copy either. Queries: q [B·K, G, E] (the
G query heads of one kv head together; row n = b·K + k). `lengths_B`: the live positions of each
row (keys 0 .. length - 1 are attended; a decoding step's query sits at position length - 1).

Grid (row blocks, cache blocks): R rows (R·K of the [B·K] axis) and `block_t` positions per step;
fp32 running max / sum / output in VMEM scratch. Runs with `interpret=True` on a CPU (the default
there), so the tests check it against the XLA path.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

NEG = -1e30      # masked scores (finite: a fully masked block leaves exp() = 0, no NaN)


def _kernel(layer_ref, last_ref, wpos_ref, wblk_ref, len_ref, q_ref, k_ref, v_ref, *rest, scale: float,
            block_t: int, n_blocks: int, tile: int, rows_total: int, write: bool):
  if write:
    kn_ref, vn_ref, o_ref, k_hbm, v_hbm, m_scr, l_scr, acc_scr, sem = rest
  else:
    o_ref, m_scr, l_scr, acc_scr = rest
  i, j = pl.program_id(0), pl.program_id(1)
  N = q_ref.shape[0]

  @pl.when(j == 0)
  def _init():
    m_scr[...] = jnp.full(m_scr.shape, NEG, jnp.float32)
    l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
    acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

  def stores(n, fn):
    """fn(k/v block, new row, HBM stack, semaphore, row n, tile start) for row n's K and V when
    its new token's position lies in this cache block."""
    off = wpos_ref[i * N + n] - j * block_t
    @pl.when((off >= 0) & (off < block_t))
    def _():
      r = jax.lax.rem(off, tile)       # off >= 0 here (and floor division's sign lowering
      t0 = pl.multiple_of(off - r, tile)  # asks for the chip, absent in a deviceless compile)
      for c, (blk, new, hbm) in enumerate(((k_ref, kn_ref, k_hbm), (v_ref, vn_ref, v_hbm))):
        fn(blk, new, hbm, sem.at[c], n, t0, r)

  def dma(blk, hbm, s, n, t0):
    row = layer_ref[0] * rows_total + i * N + n
    return pltpu.make_async_copy(blk.at[n, pl.ds(t0, tile), :],
                                 hbm.at[row, pl.ds(j * block_t + t0, tile), :], s)

  def put(blk, new, hbm, s, n, t0, r):
    # the new token into the block (so this step's attention sees it), then its tile to HBM
    at = blk[n, pl.ds(t0, tile), :]
    pick = jax.lax.broadcasted_iota(jnp.int32, at.shape, 0) == r
    row = new[pl.ds(n, 1), :].astype(at.dtype)                       # [1, E]
    blk[n, pl.ds(t0, tile), :] = jnp.where(pick, jnp.broadcast_to(row, at.shape), at)
    dma(blk, hbm, s, n, t0).start()

  # a row block's new tokens lie in its cache blocks wblk[2i] .. wblk[2i + 1] (none: empty)
  stored = (j >= wblk_ref[2 * i]) & (j <= wblk_ref[2 * i + 1])

  @pl.when(j <= last_ref[i])       # blocks past the row block's longest row: nothing to read
  def _step():
    if write:
      @pl.when(stored)
      def _put():
        jax.lax.fori_loop(0, N, lambda n, c: (stores(n, put), c)[1], 0)
    q = q_ref[...]                                                    # [N, G, E]
    k = k_ref[...].astype(q.dtype)                                    # [N, Tb, E]
    s = jnp.einsum("nge,nte->ngt", q, k, preferred_element_type=jnp.float32) * scale
    pos = j * block_t + jax.lax.broadcasted_iota(jnp.int32, s.shape, 2)
    s = jnp.where(pos < len_ref[...], s, NEG)                         # len [N, 1, 1]
    m_prev = m_scr[...]                                               # [N, G, 1]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=2, keepdims=True))
    alpha = jnp.exp(m_prev - m_new)
    p = jnp.exp(s - m_new)
    l_scr[...] = alpha * l_scr[...] + jnp.sum(p, axis=2, keepdims=True)
    v = v_ref[...].astype(q.dtype)
    acc_scr[...] = alpha * acc_scr[...] + jnp.einsum(
        "ngt,nte->nge", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    m_scr[...] = m_new
    if write:   # the tiles' copies out of the block's buffer done before the pipeline reuses it
      @pl.when(stored)
      def _wait():
        jax.lax.fori_loop(0, N, lambda n, c: (stores(
            n, lambda blk, new, hbm, s, n, t0, r: dma(blk, hbm, s, n, t0).wait()), c)[1], 0)

  @pl.when(j == n_blocks - 1)
  def _done():
    o_ref[...] = (acc_scr[...] / l_scr[...]).astype(o_ref.dtype)


# The cache blocks' share of the scoped VMEM (v5e's default limit: 16 MiB): K and V blocks of [R·K,
# block_t, E], each double-buffered by the pipeline. Qwen3-0.6B's widest (64 rows of 128 x 128 bf16)
# takes 8 MiB; Gemma 4 E4B's global layers (E 512) at batch 16 would take 16 MiB with 32 rows (XLA
# refused it: a scoped VMEM OOM), 8 MiB with 16.
KV_BLOCKS_BYTES = 8 << 20


def block_rows(batch: int, kv_heads: int, target: int = 64, block_bytes: int = 0) -> int:
  """Rows per grid step: the largest divisor R of `batch` with R·kv_heads <= max(target,
  kv_heads) (R·K query/cache rows per step), the K and V blocks' buffers (4 x R·K x `block_bytes`,
  the bytes of one cache row's block) within KV_BLOCKS_BYTES where R > 1, and R·K a multiple of 8
  unless R is the whole batch (the new keys' [B·K, E] blocks are cut on the sublane axis); the
  whole batch if none is."""
  best = 0
  for r in range(1, batch + 1):
    if batch % r == 0 and r * kv_heads <= max(target, kv_heads) and \
        (r == 1 or 4 * r * kv_heads * block_bytes <= KV_BLOCKS_BYTES) and \
        (r * kv_heads % 8 == 0 or r == batch):
      best = r
  return best or batch


def fit_block_t(length: int, block_t: int) -> int:
  """The cache block: the largest divisor of `length` that is <= block_t and a multiple of 16
  (bf16's sublane tile), or the whole length."""
  for b in range(min(block_t, length), 15, -1):
    if length % b == 0 and b % 16 == 0:
      return b
  return length


@functools.partial(jax.jit, static_argnames=("scale", "block_t", "rows", "interpret"))
def decode_attention(q_BKGE: jax.Array, k_LBKTE: jax.Array, v_LBKTE: jax.Array, layer,
                     lengths_B: jax.Array, *, scale: float, block_t: int = 128,
                     rows: int = 0, interpret: bool | None = None, new_kv=None):
  """softmax(q·kᵀ·scale over keys 0 .. lengths_B[b] - 1 of layer `layer`)·v, o [B, K, G, E] in
  q's dtype. q [B, K, G, E]; k / v the group's whole stack [L, B, K, T, E]; `layer` an int32
  scalar (traced or not); lengths >= 1 (a row with length 0 reads key 0).

  `new_kv` = (k_BKE, v_BKE, positions_B): this step's keys and values, stored at each row's
  position of layer `layer` first (a row with a position outside 0 .. T - 1 stores nothing):
  each written into the cache block the kernel holds anyway, before its attention, and that
  block's 16-position tile copied back to the stack in place (the stacks are aliased to the
  outputs), so a step's cache write costs no separate scatter. Returns (o, k stack, v stack)."""
  B, K, G, E = q_BKGE.shape
  L, _, _, T, _ = k_LBKTE.shape
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  Tb = fit_block_t(T, block_t)
  R = rows or block_rows(B, K, block_bytes=Tb * E * k_LBKTE.dtype.itemsize)
  if B % R:
    raise ValueError(f"decode_attention: rows={R} does not divide the batch {B}")
  nT, nR, N = T // Tb, B // R, R * K
  write = new_kv is not None
  lengths_B = jnp.clip(lengths_B.astype(jnp.int32), 1, T)
  last_R = (jnp.max(lengths_B.reshape(nR, R), axis=1) - 1) // Tb     # last live block per step
  len_N11 = jnp.repeat(lengths_B, K)[:, None, None]
  layer_1 = jnp.asarray(layer, jnp.int32).reshape(1)
  k_MTE = k_LBKTE.reshape(L * B * K, T, E)
  v_MTE = v_LBKTE.reshape(L * B * K, T, E)
  q_NGE = q_BKGE.reshape(B * K, G, E)
  wpos_N = jnp.full((B * K,), -1, jnp.int32)
  wblk_R2 = jnp.tile(jnp.array([1, 0], jnp.int32), nR)     # no row block stores anything
  extra, extra_specs, out_shape, out_specs, scratch, aliases = [], [], [], [], [], {}
  if write:
    k_new, v_new, wpos_B = new_kv
    wpos_N = jnp.repeat(wpos_B.astype(jnp.int32), K)
    stores_RR = ((wpos_B >= 0) & (wpos_B < T)).reshape(nR, R)
    blk_RR = wpos_B.astype(jnp.int32).reshape(nR, R) // Tb
    wblk_R2 = jnp.stack([jnp.min(jnp.where(stores_RR, blk_RR, nT), axis=1),
                         jnp.max(jnp.where(stores_RR, blk_RR, -1), axis=1)], axis=1).reshape(-1)
    # fp32 [B·K, E]: the producers' [B, K, E] as it is (bf16 rows of one would be re-laid)
    extra = [k_new.astype(jnp.float32).reshape(B * K, E),
             v_new.astype(jnp.float32).reshape(B * K, E)]
    extra_specs = [pl.BlockSpec((N, E), lambda i, j, *_: (i, 0))] * 2
    out_shape = [jax.ShapeDtypeStruct(k_MTE.shape, k_MTE.dtype),
                 jax.ShapeDtypeStruct(v_MTE.shape, v_MTE.dtype)]
    out_specs = [pl.BlockSpec(memory_space=pl.ANY)] * 2
    scratch = [pltpu.SemaphoreType.DMA((2,))]
    aliases = {6: 1, 7: 2}   # (layer, last, wpos, wblk, len, q, k, v, ...): k, v -> outputs 1, 2

  def kv_map(i, j, layer_ref, last_ref, *_):
    return (layer_ref[0] * nR + i, jnp.minimum(j, last_ref[i]), 0)

  kernel = functools.partial(_kernel, scale=scale, block_t=Tb, n_blocks=nT,
                             tile=16 if Tb % 16 == 0 else Tb, rows_total=B * K, write=write)
  out = pl.pallas_call(
      kernel,
      out_shape=[jax.ShapeDtypeStruct(q_NGE.shape, q_NGE.dtype), *out_shape],
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=4,
          grid=(nR, nT),
          in_specs=[pl.BlockSpec((N, 1, 1), lambda i, j, *_: (i, 0, 0)),
                    pl.BlockSpec((N, G, E), lambda i, j, *_: (i, 0, 0)),
                    pl.BlockSpec((N, Tb, E), kv_map),
                    pl.BlockSpec((N, Tb, E), kv_map), *extra_specs],
          out_specs=[pl.BlockSpec((N, G, E), lambda i, j, *_: (i, 0, 0)), *out_specs],
          scratch_shapes=[pltpu.VMEM((N, G, 1), jnp.float32),
                          pltpu.VMEM((N, G, 1), jnp.float32),
                          pltpu.VMEM((N, G, E), jnp.float32), *scratch]),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
      input_output_aliases=aliases,
      interpret=interpret,
  )(layer_1, last_R, wpos_N, wblk_R2, len_N11, q_NGE, k_MTE, v_MTE, *extra)
  o_BKGE = out[0].reshape(B, K, G, E)
  if not write:
    return o_BKGE
  return o_BKGE, out[1].reshape(k_LBKTE.shape), out[2].reshape(v_LBKTE.shape)
