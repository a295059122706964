"""Flash attention in Pallas: online-softmax forward, dq and dk/dv backward kernels.

Layouts follow `MaxText.layers.attention_ops`: q [B,S,H,E], k/v [B,T,K,E] with H % K == 0 (GQA:
query head h reads kv head h // (H//K) through the BlockSpec index map; K/V are never repeated).
Masks: causal (query i sees keys j <= i), sliding window W (keys j > i - W), segment ids (equal ids
only), padded keys of ragged lengths. kv blocks (q blocks in the dk/dv kernel) that the causal /
window masks rule out entirely are skipped by the loop bounds, not merely masked.

Runs through the Triton lowering on GPU and with `interpret=True` on CPU. The pieces the forward
and backward kernels share are in flash_common.py (the backward kernels: flash_attention_bwd.py).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl

from MaxText.kernels.flash_attention_bwd import backward
from MaxText.kernels.flash_common import (M_INIT, MASK_VALUE, SQ, KernelConfig, check_inputs, compiler_params,
                                          dot, kernel_refs, kv_block_range, masked_scores,
                                          off_args, q_block_range, seg_args, start_positions)

__all__ = ["check_inputs", "flash_attention", "flash_attention_debug_counts", "flash_block_backward",
           "flash_block_forward", "kv_block_range", "q_block_range"]


# ----------------------------------------------------------------------------- forward kernel
def _fwd_kernel(*refs, cfg: KernelConfig, has_seg: bool):
  (q_ref, k_ref, v_ref), qs_ref, ks_ref, off_ref, outs = kernel_refs(
      refs, n_in=3, has_seg=has_seg, has_off=cfg.offsets)
  o_ref, lse_ref = outs[0], outs[1]
  bq, bk = cfg.block_q, cfg.block_kv
  qi = pl.program_id(2)
  q = q_ref[...]
  q0, k0 = start_positions(off_ref)
  q_pos = q0 + qi * bq + lax.broadcasted_iota(jnp.int32, (bq,), 0)
  q_seg = None if qs_ref is None else qs_ref[...]

  def body(j, carry):
    acc, m, l, count = carry
    k = k_ref[pl.ds(j * bk, bk), :]
    v = v_ref[pl.ds(j * bk, bk), :]
    k_pos = k0 + j * bk + lax.broadcasted_iota(jnp.int32, (bk,), 0)
    k_seg = None if ks_ref is None else ks_ref[pl.ds(j * bk, bk)]
    s = masked_scores(q, k, q_pos, k_pos, q_seg, k_seg, cfg, k0)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[:, None])
    l = alpha * l + jnp.sum(p, axis=-1)
    acc = alpha[:, None] * acc + dot(p.astype(v.dtype), v)
    return acc, m_new, l, count + 1.0

  lo, hi = kv_block_range(qi, block_q=bq, block_kv=bk, num_kv_blocks=cfg.num_kv_blocks,
                          causal=cfg.causal, window=cfg.window, shift=q0 - k0)
  init = (jnp.zeros((bq, q.shape[-1]), jnp.float32), jnp.full((bq,), M_INIT, jnp.float32),
          jnp.zeros((bq,), jnp.float32), jnp.zeros((bq,), jnp.float32))
  acc, m, l, count = lax.fori_loop(lo, hi, body, init)
  empty = l == 0.0                              # rows with no visible key (padding only)
  l_safe = jnp.where(empty, 1.0, l)
  o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(empty, cfg.empty_lse, m + jnp.log(l_safe))
  if cfg.debug_counts:
    outs[2][...] = count


def _forward(q, k, v, q_seg, kv_seg, cfg: KernelConfig, offsets=None):
  """Padded inputs → (o [B,Sp,H,E], lse [B,H,Sp] fp32[, kv-block iteration counts [B,H,Sp]]);
  `offsets` (cfg.offsets): int32 [2], the first query's and the first key's positions."""
  B, Sp, H, E = q.shape
  Tp = k.shape[1]
  bq, G = cfg.block_q, cfg.groups
  has_seg = q_seg is not None
  in_specs = [pl.BlockSpec((SQ, bq, SQ, E), lambda b, h, i: (b, i, h, 0)),
              pl.BlockSpec((SQ, Tp, SQ, E), lambda b, h, i: (b, 0, h // G, 0)),
              pl.BlockSpec((SQ, Tp, SQ, E), lambda b, h, i: (b, 0, h // G, 0))]
  if has_seg:
    in_specs += [pl.BlockSpec((SQ, bq), lambda b, h, i: (b, i)),
                 pl.BlockSpec((SQ, Tp), lambda b, h, i: (b, 0))]
  if cfg.offsets:
    in_specs.append(pl.BlockSpec((2,), lambda b, h, i: (0,)))
  row_spec = pl.BlockSpec((SQ, SQ, bq), lambda b, h, i: (b, h, i))
  out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype),
               jax.ShapeDtypeStruct((B, H, Sp), jnp.float32)]
  out_specs = [pl.BlockSpec((SQ, bq, SQ, E), lambda b, h, i: (b, i, h, 0)), row_spec]
  if cfg.debug_counts:
    out_shape.append(jax.ShapeDtypeStruct((B, H, Sp), jnp.float32))
    out_specs.append(row_spec)
  return pl.pallas_call(
      functools.partial(_fwd_kernel, cfg=cfg, has_seg=has_seg),
      grid=(B, H, cfg.num_q_blocks), in_specs=in_specs, out_specs=out_specs,
      out_shape=out_shape, compiler_params=compiler_params(E), interpret=cfg.interpret,
      name="flash_attention_fwd",
  )(q, k, v, *seg_args(q_seg, kv_seg), *off_args(offsets))


# ----------------------------------------------------------------------------- custom vjp
@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _flash(q, k, v, q_seg, kv_seg, offsets, cfg: KernelConfig):
  return _forward(q, k, v, q_seg, kv_seg, cfg, offsets)[0]


def _flash_fwd(q, k, v, q_seg, kv_seg, offsets, cfg: KernelConfig):
  o, lse = _forward(q, k, v, q_seg, kv_seg, cfg, offsets)[:2]
  o = checkpoint_name(o, "flash_out")
  lse = checkpoint_name(lse, "flash_lse")
  return o, (q, k, v, q_seg, kv_seg, offsets, o, lse)


def _flash_bwd(cfg: KernelConfig, res, do):
  q, k, v, q_seg, kv_seg, offsets, o, lse = res
  dq, dk, dv = backward(q, k, v, q_seg, kv_seg, o, lse, do, cfg, offsets)
  return dq, dk, dv, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# ----------------------------------------------------------------------------- public wrapper
def triton_max_block(head_dim: int) -> int:
  """The largest query / key block the Triton kernels take for a (padded) head dim: the backward
  program holds q, k, v, dO tiles and fp32 accumulators of block x head_dim at once, and 512-row
  blocks of a 128-wide head ask several times an H100/H200's 227 KiB of shared memory. The
  configured blocks (`flash_block_q` / `flash_block_kv`, sized for the CPU interpreter) are
  clipped to this on a GPU."""
  return 128 if head_dim <= 128 else 64


def _next_pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def _prepare(q_BSHE, k_BTKE, v_BTKE, segment_ids_BS, *, scale, causal, sliding_window,
             block_q, block_kv, interpret, debug_counts=False, kv_segment_ids_BT=None,
             offsets=None, empty_lse=0.0):
  """Pads sequence lengths to block multiples and the head dim to a power of two."""
  B, S, H, E = q_BSHE.shape
  T, K = k_BTKE.shape[1], k_BTKE.shape[2]
  if kv_segment_ids_BT is None:
    check_inputs(q_BSHE, k_BTKE, v_BTKE, segment_ids_BS, sliding_window)
    kv_segment_ids_BT = segment_ids_BS
  else:
    check_inputs(q_BSHE, k_BTKE, v_BTKE, None, sliding_window)
    if segment_ids_BS is None or segment_ids_BS.shape != (B, S) or kv_segment_ids_BT.shape != (B, T):
      raise ValueError("kv_segment_ids_BT [B, T] needs segment_ids_BS [B, S] with it")
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  Ep = _next_pow2(E)
  if not interpret:        # Triton: one program's tiles must fit the GPU's shared memory
    block_q, block_kv = (min(b, triton_max_block(Ep)) for b in (block_q, block_kv))
  bq = min(block_q, max(16, _next_pow2(S)))     # short sequences: one block (>= 16 for Triton dots)
  bk = min(block_kv, max(16, _next_pow2(T)))
  nq, nk = pl.cdiv(S, bq), pl.cdiv(T, bk)
  Sp, Tp = nq * bq, nk * bk
  q = jnp.pad(q_BSHE, ((0, 0), (0, Sp - S), (0, 0), (0, Ep - E)))
  k = jnp.pad(k_BTKE, ((0, 0), (0, Tp - T), (0, 0), (0, Ep - E)))
  v = jnp.pad(v_BTKE, ((0, 0), (0, Tp - T), (0, 0), (0, Ep - E)))
  q_seg = kv_seg = None
  if segment_ids_BS is not None:   # padded positions get ids that never match (keys: also kv_len)
    q_seg = jnp.pad(segment_ids_BS.astype(jnp.int32), ((0, 0), (0, Sp - S)), constant_values=-1)
    kv_seg = jnp.pad(kv_segment_ids_BT.astype(jnp.int32), ((0, 0), (0, Tp - T)),
                     constant_values=-2)
  if offsets is not None:
    offsets = jnp.asarray(offsets, jnp.int32).reshape(2)
  cfg = KernelConfig(scale=float(scale), causal=bool(causal),
             window=None if sliding_window is None else int(sliding_window),
             block_q=bq, block_kv=bk, num_q_blocks=nq, num_kv_blocks=nk, kv_len=T,
             kv_padded=Tp != T, groups=H // K, interpret=bool(interpret), debug_counts=debug_counts,
             offsets=offsets is not None, empty_lse=float(empty_lse))
  return q, k, v, q_seg, kv_seg, offsets, cfg


def flash_attention(q_BSHE, k_BTKE, v_BTKE, segment_ids_BS=None, *, scale: float,
                    causal: bool = True, sliding_window: int | None = None,
                    block_q: int = 128, block_kv: int = 128, interpret: bool | None = None,
                    kv_segment_ids_BT=None, offsets=None):
  """Flash attention; same contract as `attention_ops.dot_product_attention` plus options.

  sliding_window=W: query i sees keys j > i - W (with causal: i - W < j <= i).
  interpret=None: interpret mode when the default backend is CPU.
  kv_segment_ids_BT: the keys' segment ids when they are not the queries' (S != T allowed).
  offsets: int32 [2] (may be traced), the first query's and the first key's positions in the
  sequence (the masks compare positions; default both 0) — a chunk of a longer sequence.
  Returns [B, S, H, E] in q's dtype. Differentiable w.r.t. q, k, v (custom VJP, Pallas kernels).
  """
  S, E = q_BSHE.shape[1], q_BSHE.shape[3]
  q, k, v, q_seg, kv_seg, offsets, cfg = _prepare(
      q_BSHE, k_BTKE, v_BTKE, segment_ids_BS, scale=scale, causal=causal,
      sliding_window=sliding_window, block_q=block_q, block_kv=block_kv, interpret=interpret,
      kv_segment_ids_BT=kv_segment_ids_BT, offsets=offsets)
  o = _flash(q, k, v, q_seg, kv_seg, offsets, cfg)
  return o[:, :S, :, :E]  # pyright: ignore[reportIndexIssue] (jax.custom_vjp's result is untyped)


def flash_block_forward(q_BSHE, k_BTKE, v_BTKE, segment_ids_BS, kv_segment_ids_BT, offsets, *,
                        scale: float, causal: bool, sliding_window: int | None, block_q: int,
                        block_kv: int, interpret: bool | None = None):
  """One block of a blockwise (ring) attention, not differentiable: (o [B,S,H,E] in q's dtype,
  lse [B,H,S] fp32), rows that see no key of this block with o = 0 and lse = MASK_VALUE (so that
  merging blocks by their lse weighs them 0). Arguments as `flash_attention`'s."""
  S, E = q_BSHE.shape[1], q_BSHE.shape[3]
  q, k, v, q_seg, kv_seg, offsets, cfg = _prepare(
      q_BSHE, k_BTKE, v_BTKE, segment_ids_BS, scale=scale, causal=causal,
      sliding_window=sliding_window, block_q=block_q, block_kv=block_kv, interpret=interpret,
      kv_segment_ids_BT=kv_segment_ids_BT, offsets=offsets, empty_lse=MASK_VALUE)
  o, lse = _forward(q, k, v, q_seg, kv_seg, cfg, offsets)[:2]
  return o[:, :S, :, :E], lse[:, :, :S]


def flash_block_backward(q_BSHE, k_BTKE, v_BTKE, segment_ids_BS, kv_segment_ids_BT, offsets,
                         o_BSHE, lse_BHS, do_BSHE, *, scale: float, causal: bool,
                         sliding_window: int | None, block_q: int, block_kv: int,
                         interpret: bool | None = None):
  """The (dq, dk, dv) of one block given the whole attention's output `o` and `lse` (the merged
  ones; 0 for rows that see no key at all) and the output cotangent `do`: summed over the blocks,
  these are the gradients of the whole attention."""
  S, E = q_BSHE.shape[1], q_BSHE.shape[3]
  T = k_BTKE.shape[1]
  q, k, v, q_seg, kv_seg, offsets, cfg = _prepare(
      q_BSHE, k_BTKE, v_BTKE, segment_ids_BS, scale=scale, causal=causal,
      sliding_window=sliding_window, block_q=block_q, block_kv=block_kv, interpret=interpret,
      kv_segment_ids_BT=kv_segment_ids_BT, offsets=offsets)
  Sp, Ep = q.shape[1], q.shape[3]
  pad = ((0, 0), (0, Sp - S), (0, 0), (0, Ep - E))
  o, do = jnp.pad(o_BSHE, pad), jnp.pad(do_BSHE, pad)
  lse = jnp.pad(lse_BHS, ((0, 0), (0, 0), (0, Sp - S)))
  dq, dk, dv = backward(q, k, v, q_seg, kv_seg, o, lse, do, cfg, offsets)
  return dq[:, :S, :, :E], dk[:, :T, :, :E], dv[:, :T, :, :E]


def flash_attention_debug_counts(q_BSHE, k_BTKE, v_BTKE, segment_ids_BS=None, **kwargs):
  """Forward only; returns (o, kv-block iterations run per query row [B, H, S]) for tests."""
  S, E = q_BSHE.shape[1], q_BSHE.shape[3]
  kwargs.setdefault("causal", True)
  for name, default in (("sliding_window", None), ("block_q", 128), ("block_kv", 128),
                        ("interpret", None)):
    kwargs.setdefault(name, default)
  q, k, v, q_seg, kv_seg, offsets, cfg = _prepare(q_BSHE, k_BTKE, v_BTKE, segment_ids_BS,
                                                  debug_counts=True, **kwargs)
  o, _, counts = _forward(q, k, v, q_seg, kv_seg, cfg, offsets)
  return o[:, :S, :, :E], counts[:, :, :S]
