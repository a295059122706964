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
from MaxText.kernels.flash_common import (M_INIT, SQ, KernelConfig, check_inputs, compiler_params,
                                          dot, kv_block_range, masked_scores, q_block_range,
                                          seg_args)

__all__ = ["check_inputs", "flash_attention", "flash_attention_debug_counts", "kv_block_range",
           "q_block_range"]


# ----------------------------------------------------------------------------- forward kernel
def _fwd_kernel(*refs, cfg: KernelConfig, has_seg: bool):
  if has_seg:
    q_ref, k_ref, v_ref, qs_ref, ks_ref, *outs = refs
  else:
    (q_ref, k_ref, v_ref, *outs), qs_ref, ks_ref = refs, None, None
  o_ref, lse_ref = outs[0], outs[1]
  bq, bk = cfg.block_q, cfg.block_kv
  qi = pl.program_id(2)
  q = q_ref[...]
  q_pos = qi * bq + lax.broadcasted_iota(jnp.int32, (bq,), 0)
  q_seg = qs_ref[...] if has_seg else None

  def body(j, carry):
    acc, m, l, count = carry
    k = k_ref[pl.ds(j * bk, bk), :]
    v = v_ref[pl.ds(j * bk, bk), :]
    k_pos = j * bk + lax.broadcasted_iota(jnp.int32, (bk,), 0)
    k_seg = ks_ref[pl.ds(j * bk, bk)] if has_seg else None
    s = masked_scores(q, k, q_pos, k_pos, q_seg, k_seg, cfg)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[:, None])
    l = alpha * l + jnp.sum(p, axis=-1)
    acc = alpha[:, None] * acc + dot(p.astype(v.dtype), v)
    return acc, m_new, l, count + 1.0

  lo, hi = kv_block_range(qi, block_q=bq, block_kv=bk, num_kv_blocks=cfg.num_kv_blocks,
                          causal=cfg.causal, window=cfg.window)
  init = (jnp.zeros((bq, q.shape[-1]), jnp.float32), jnp.full((bq,), M_INIT, jnp.float32),
          jnp.zeros((bq,), jnp.float32), jnp.zeros((bq,), jnp.float32))
  acc, m, l, count = lax.fori_loop(lo, hi, body, init)
  empty = l == 0.0                              # rows with no visible key (padding only)
  l_safe = jnp.where(empty, 1.0, l)
  o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(empty, 0.0, m + jnp.log(l_safe))
  if cfg.debug_counts:
    outs[2][...] = count


def _forward(q, k, v, q_seg, kv_seg, cfg: KernelConfig):
  """Padded inputs → (o [B,Sp,H,E], lse [B,H,Sp] fp32[, kv-block iteration counts [B,H,Sp]])."""
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
  )(q, k, v, *seg_args(q_seg, kv_seg))


# ----------------------------------------------------------------------------- custom vjp
@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q, k, v, q_seg, kv_seg, cfg: KernelConfig):
  return _forward(q, k, v, q_seg, kv_seg, cfg)[0]


def _flash_fwd(q, k, v, q_seg, kv_seg, cfg: KernelConfig):
  o, lse = _forward(q, k, v, q_seg, kv_seg, cfg)[:2]
  o = checkpoint_name(o, "flash_out")
  lse = checkpoint_name(lse, "flash_lse")
  return o, (q, k, v, q_seg, kv_seg, o, lse)


def _flash_bwd(cfg: KernelConfig, res, do):
  q, k, v, q_seg, kv_seg, o, lse = res
  dq, dk, dv = backward(q, k, v, q_seg, kv_seg, o, lse, do, cfg)
  return dq, dk, dv, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# ----------------------------------------------------------------------------- public wrapper
def _next_pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def _prepare(q_BSHE, k_BTKE, v_BTKE, segment_ids_BS, *, scale, causal, sliding_window,
             block_q, block_kv, interpret, debug_counts=False):
  """Pads sequence lengths to block multiples and the head dim to a power of two."""
  check_inputs(q_BSHE, k_BTKE, v_BTKE, segment_ids_BS, sliding_window)
  B, S, H, E = q_BSHE.shape
  T, K = k_BTKE.shape[1], k_BTKE.shape[2]
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  bq = min(block_q, max(16, _next_pow2(S)))     # short sequences: one block (>= 16 for Triton dots)
  bk = min(block_kv, max(16, _next_pow2(T)))
  nq, nk = pl.cdiv(S, bq), pl.cdiv(T, bk)
  Sp, Tp, Ep = nq * bq, nk * bk, _next_pow2(E)
  q = jnp.pad(q_BSHE, ((0, 0), (0, Sp - S), (0, 0), (0, Ep - E)))
  k = jnp.pad(k_BTKE, ((0, 0), (0, Tp - T), (0, 0), (0, Ep - E)))
  v = jnp.pad(v_BTKE, ((0, 0), (0, Tp - T), (0, 0), (0, Ep - E)))
  q_seg = kv_seg = None
  if segment_ids_BS is not None:   # padded positions get ids that never match (keys: also kv_len)
    seg = segment_ids_BS.astype(jnp.int32)
    q_seg = jnp.pad(seg, ((0, 0), (0, Sp - S)), constant_values=-1)
    kv_seg = jnp.pad(seg, ((0, 0), (0, Tp - T)), constant_values=-2)
  cfg = KernelConfig(scale=float(scale), causal=bool(causal),
             window=None if sliding_window is None else int(sliding_window),
             block_q=bq, block_kv=bk, num_q_blocks=nq, num_kv_blocks=nk, kv_len=T,
             kv_padded=Tp != T, groups=H // K, interpret=bool(interpret), debug_counts=debug_counts)
  return q, k, v, q_seg, kv_seg, cfg


def flash_attention(q_BSHE, k_BTKE, v_BTKE, segment_ids_BS=None, *, scale: float,
                    causal: bool = True, sliding_window: int | None = None,
                    block_q: int = 128, block_kv: int = 128, interpret: bool | None = None):
  """Flash attention; same contract as `attention_ops.dot_product_attention` plus options.

  sliding_window=W: query i sees keys j > i - W (with causal: i - W < j <= i).
  interpret=None: interpret mode when the default backend is CPU.
  Returns [B, S, H, E] in q's dtype. Differentiable w.r.t. q, k, v (custom VJP, Pallas kernels).
  """
  S, E = q_BSHE.shape[1], q_BSHE.shape[3]
  q, k, v, q_seg, kv_seg, cfg = _prepare(
      q_BSHE, k_BTKE, v_BTKE, segment_ids_BS, scale=scale, causal=causal,
      sliding_window=sliding_window, block_q=block_q, block_kv=block_kv, interpret=interpret)
  o = _flash(q, k, v, q_seg, kv_seg, cfg)
  return o[:, :S, :, :E]  # pyright: ignore[reportIndexIssue] (jax.custom_vjp's result is untyped)


def flash_attention_debug_counts(q_BSHE, k_BTKE, v_BTKE, segment_ids_BS=None, **kwargs):
  """Forward only; returns (o, kv-block iterations run per query row [B, H, S]) for tests."""
  S, E = q_BSHE.shape[1], q_BSHE.shape[3]
  kwargs.setdefault("causal", True)
  for name, default in (("sliding_window", None), ("block_q", 128), ("block_kv", 128),
                        ("interpret", None)):
    kwargs.setdefault(name, default)
  q, k, v, q_seg, kv_seg, cfg = _prepare(q_BSHE, k_BTKE, v_BTKE, segment_ids_BS,
                                         debug_counts=True, **kwargs)
  o, _, counts = _forward(q, k, v, q_seg, kv_seg, cfg)
  return o[:, :S, :, :E], counts[:, :, :S]
