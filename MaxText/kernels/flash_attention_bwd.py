"""Backward Pallas kernels of flash attention: dq (grid over q blocks, loop over kv blocks) and
dk/dv (grid over kv blocks, loop over q blocks). Both recompute p = exp(s - lse) per block.

GQA: the dk/dv kernel runs per query head (reading its kv head through the index map, K/V are never
repeated) and writes fp32 per-query-head partials [B, T, H, E]; the G heads of a kv head are summed
afterwards over a reshaped axis.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from MaxText.kernels.flash_common import (SQ, KernelConfig, compiler_params, dot, kernel_refs,
                                          kv_block_range, masked_scores, off_args, q_block_range,
                                          seg_args, start_positions)


def _dq_kernel(*refs, cfg: KernelConfig, has_seg: bool):
  (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), qs_ref, ks_ref, off_ref, (dq_ref,) = \
      kernel_refs(refs, n_in=6, has_seg=has_seg, has_off=cfg.offsets)
  bq, bk = cfg.block_q, cfg.block_kv
  qi = pl.program_id(2)
  q, do = q_ref[...], do_ref[...]
  lse, delta = lse_ref[...], delta_ref[...]
  q0, k0 = start_positions(off_ref)
  q_pos = q0 + qi * bq + lax.broadcasted_iota(jnp.int32, (bq,), 0)
  q_seg = None if qs_ref is None else qs_ref[...]

  def body(j, dq):
    k = k_ref[pl.ds(j * bk, bk), :]
    v = v_ref[pl.ds(j * bk, bk), :]
    k_pos = k0 + j * bk + lax.broadcasted_iota(jnp.int32, (bk,), 0)
    k_seg = None if ks_ref is None else ks_ref[pl.ds(j * bk, bk)]
    s = masked_scores(q, k, q_pos, k_pos, q_seg, k_seg, cfg, k0)
    p = jnp.exp(s - lse[:, None])
    dp = dot(do, v, tb=True)
    ds = p * (dp - delta[:, None])      # softmax backward: dL/d(scaled scores)
    return dq + dot(ds.astype(k.dtype), k)

  lo, hi = kv_block_range(qi, block_q=bq, block_kv=bk, num_kv_blocks=cfg.num_kv_blocks,
                          causal=cfg.causal, window=cfg.window, shift=q0 - k0)
  dq = lax.fori_loop(lo, hi, body, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)


def _dkv_kernel(*refs, cfg: KernelConfig, has_seg: bool):
  (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), qs_ref, ks_ref, off_ref, (dk_ref, dv_ref) = \
      kernel_refs(refs, n_in=6, has_seg=has_seg, has_off=cfg.offsets)
  bq, bk = cfg.block_q, cfg.block_kv
  kj = pl.program_id(2)
  k, v = k_ref[...], v_ref[...]
  q0, k0 = start_positions(off_ref)
  k_pos = k0 + kj * bk + lax.broadcasted_iota(jnp.int32, (bk,), 0)
  k_seg = None if ks_ref is None else ks_ref[...]

  def body(i, carry):
    dk, dv = carry
    q = q_ref[pl.ds(i * bq, bq), :]
    do = do_ref[pl.ds(i * bq, bq), :]
    lse = lse_ref[pl.ds(i * bq, bq)]
    delta = delta_ref[pl.ds(i * bq, bq)]
    q_pos = q0 + i * bq + lax.broadcasted_iota(jnp.int32, (bq,), 0)
    q_seg = None if qs_ref is None else qs_ref[pl.ds(i * bq, bq)]
    s = masked_scores(q, k, q_pos, k_pos, q_seg, k_seg, cfg, k0)
    p = jnp.exp(s - lse[:, None])
    dv = dv + dot(p.astype(do.dtype), do, ta=True)
    dp = dot(do, v, tb=True)
    ds = p * (dp - delta[:, None])      # softmax backward: dL/d(scaled scores)
    dk = dk + dot(ds.astype(q.dtype), q, ta=True)
    return dk, dv

  lo, hi = q_block_range(kj, block_q=bq, block_kv=bk, num_q_blocks=cfg.num_q_blocks,
                         causal=cfg.causal, window=cfg.window, shift=q0 - k0)
  zeros = jnp.zeros(k.shape, jnp.float32)
  dk, dv = lax.fori_loop(lo, hi, body, (zeros, zeros))
  dk_ref[...] = dk * cfg.scale
  dv_ref[...] = dv


def backward(q, k, v, q_seg, kv_seg, o, lse, do, cfg: KernelConfig, offsets=None):
  """Padded residuals + cotangent → (dq, dk, dv) in the input dtypes (`offsets`: as the
  forward's)."""
  B, Sp, H, E = q.shape
  Tp, K = k.shape[1], k.shape[2]
  bq, bk, G = cfg.block_q, cfg.block_kv, cfg.groups
  has_seg = q_seg is not None
  delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1).transpose(0, 2, 1)
  seg = (*seg_args(q_seg, kv_seg), *off_args(offsets))
  off_spec = [pl.BlockSpec((2,), lambda b, h, i: (0,))] if cfg.offsets else []

  q_blk = pl.BlockSpec((SQ, bq, SQ, E), lambda b, h, i: (b, i, h, 0))
  kv_full = pl.BlockSpec((SQ, Tp, SQ, E), lambda b, h, i: (b, 0, h // G, 0))
  row_blk = pl.BlockSpec((SQ, SQ, bq), lambda b, h, i: (b, h, i))
  seg_specs = ([pl.BlockSpec((SQ, bq), lambda b, h, i: (b, i)),
                pl.BlockSpec((SQ, Tp), lambda b, h, i: (b, 0))] if has_seg else []) + off_spec
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, cfg=cfg, has_seg=has_seg),
      grid=(B, H, cfg.num_q_blocks),
      in_specs=[q_blk, kv_full, kv_full, q_blk, row_blk, row_blk, *seg_specs],
      out_specs=q_blk, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      compiler_params=compiler_params(E), interpret=cfg.interpret, name="flash_attention_dq",
  )(q, k, v, do, lse, delta, *seg)

  q_full = pl.BlockSpec((SQ, Sp, SQ, E), lambda b, h, j: (b, 0, h, 0))
  kv_blk = pl.BlockSpec((SQ, bk, SQ, E), lambda b, h, j: (b, j, h // G, 0))
  row_full = pl.BlockSpec((SQ, SQ, Sp), lambda b, h, j: (b, h, 0))
  dkv_blk = pl.BlockSpec((SQ, bk, SQ, E), lambda b, h, j: (b, j, h, 0))
  seg_specs = ([pl.BlockSpec((SQ, Sp), lambda b, h, j: (b, 0)),
                pl.BlockSpec((SQ, bk), lambda b, h, j: (b, j))] if has_seg else []) + off_spec
  part = jax.ShapeDtypeStruct((B, Tp, H, E), jnp.float32)
  dk_h, dv_h = pl.pallas_call(
      functools.partial(_dkv_kernel, cfg=cfg, has_seg=has_seg),
      grid=(B, H, cfg.num_kv_blocks),
      in_specs=[q_full, kv_blk, kv_blk, q_full, row_full, row_full, *seg_specs],
      out_specs=[dkv_blk, dkv_blk], out_shape=[part, part],
      compiler_params=compiler_params(E), interpret=cfg.interpret, name="flash_attention_dkv",
  )(q, k, v, do, lse, delta, *seg)
  dk = dk_h.reshape(B, Tp, K, G, E).sum(axis=3).astype(k.dtype)
  dv = dv_h.reshape(B, Tp, K, G, E).sum(axis=3).astype(v.dtype)
  return dq, dk, dv
