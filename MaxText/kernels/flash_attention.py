"""Flash attention in Pallas: online-softmax forward, dq and dk/dv backward kernels.

Layouts follow `MaxText.layers.attention_ops`: q [B,S,H,E], k/v [B,T,K,E] with H % K == 0 (GQA:
query head h reads kv head h // (H//K) through the BlockSpec index map; K/V are never repeated).
Masks: causal (query i sees keys j <= i), sliding window W (keys j > i - W), segment ids (equal ids
only), padded keys of ragged lengths. kv blocks (q blocks in the dk/dv kernel) that the causal /
window masks rule out entirely are skipped by the loop bounds, not merely masked.

Runs through the Triton lowering on GPU and with `interpret=True` on CPU.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl

try:   # Triton compiler params also select the Triton lowering (not Mosaic GPU) on GPU
  from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover
  pltriton = None

_SQ = getattr(pl, "squeezed", None)   # squeezed block dim (None on older jax)
MASK_VALUE = -1e30            # masked scores; finite so that no inf - inf appears
_M_INIT = 0.5 * MASK_VALUE    # running-max start above MASK_VALUE: masked entries give exp(.) = 0


@dataclasses.dataclass(frozen=True)
class _Cfg:
  """Static configuration shared by all kernels (hashable: used as a nondiff argument)."""
  scale: float
  causal: bool
  window: int | None
  softcap: float | None
  block_q: int
  block_kv: int
  num_q_blocks: int
  num_kv_blocks: int
  kv_len: int              # real (unpadded) kv length; keys at positions >= kv_len are masked
  kv_padded: bool
  groups: int              # G = H // K
  interpret: bool
  debug_counts: bool = False


# ----------------------------------------------------------------------------- block bounds
def _div(x, d: int):
  """Floor division of a non-negative python or traced int by a positive python int."""
  if isinstance(x, int):
    return x // d
  return lax.div(x, jnp.asarray(d, x.dtype))


def _max(a, b):
  return max(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.maximum(a, b)


def _min(a, b):
  return min(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.minimum(a, b)


def kv_block_range(q_block, *, block_q: int, block_kv: int, num_kv_blocks: int, causal: bool,
                   window: int | None):
  """[lo, hi) of the kv blocks that query block `q_block` can see (causal / window masks)."""
  lo, hi = 0, num_kv_blocks
  if window is not None:                       # first query q0 sees keys > q0 - window
    lo = _div(_max(q_block * block_q - window + 1, 0), block_kv)
  if causal:                                   # last query sees keys <= itself
    hi = _min(hi, _div(q_block * block_q + block_q - 1, block_kv) + 1)
  return _min(lo, hi), hi


def q_block_range(kv_block, *, block_q: int, block_kv: int, num_q_blocks: int, causal: bool,
                  window: int | None):
  """[lo, hi) of the query blocks that can see kv block `kv_block` (causal / window masks)."""
  lo, hi = 0, num_q_blocks
  if causal:                                   # queries >= first key of the block
    lo = _div(kv_block * block_kv, block_q)
  if window is not None:                       # queries < last key + window
    hi = _min(hi, _div(kv_block * block_kv + block_kv - 1 + window - 1, block_q) + 1)
  return _min(lo, hi), hi


# ----------------------------------------------------------------------------- shared pieces
def compiler_params(head_dim: int):
  """Triton parameters (ignored in interpret mode); passing them forces the Triton lowering."""
  if pltriton is None:
    return None
  return pltriton.CompilerParams(num_warps=4 if head_dim <= 64 else 8, num_stages=2)


def _dot(a, b, *, ta: bool = False, tb: bool = False):
  """2-D matmul with optional transposes, fp32 accumulation (full precision for fp32 inputs)."""
  dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
  precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _scores(q, k, cfg: _Cfg):
  """Scaled (and soft-capped) scores [bq, bk] in fp32; also tanh(.) for the soft-cap derivative."""
  s = _dot(q, k, tb=True) * cfg.scale
  if cfg.softcap is None:
    return s, None
  t = jnp.tanh(s / cfg.softcap)
  return cfg.softcap * t, t


def _mask(q_pos, k_pos, q_seg, k_seg, cfg: _Cfg):
  """Boolean [bq, bk] mask (True = attend), or None when nothing is masked."""
  mask = None

  def conj(m, new):
    return new if m is None else jnp.logical_and(m, new)

  if cfg.causal:
    mask = conj(mask, q_pos[:, None] >= k_pos[None, :])
  if cfg.window is not None:
    mask = conj(mask, k_pos[None, :] > q_pos[:, None] - cfg.window)
  if q_seg is not None:
    mask = conj(mask, q_seg[:, None] == k_seg[None, :])
  if cfg.kv_padded:
    mask = conj(mask, jnp.broadcast_to(k_pos[None, :] < cfg.kv_len,
                                       (q_pos.shape[0], k_pos.shape[0])))
  return mask


def _masked_scores(q, k, q_pos, k_pos, q_seg, k_seg, cfg: _Cfg):
  s, t = _scores(q, k, cfg)
  mask = _mask(q_pos, k_pos, q_seg, k_seg, cfg)
  if mask is not None:
    s = jnp.where(mask, s, MASK_VALUE)
  return s, t


# ----------------------------------------------------------------------------- forward kernel
def _fwd_kernel(*refs, cfg: _Cfg, has_seg: bool):
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
    s, _ = _masked_scores(q, k, q_pos, k_pos, q_seg, k_seg, cfg)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[:, None])
    l = alpha * l + jnp.sum(p, axis=-1)
    acc = alpha[:, None] * acc + _dot(p.astype(v.dtype), v)
    return acc, m_new, l, count + 1.0

  lo, hi = kv_block_range(qi, block_q=bq, block_kv=bk, num_kv_blocks=cfg.num_kv_blocks,
                          causal=cfg.causal, window=cfg.window)
  init = (jnp.zeros((bq, q.shape[-1]), jnp.float32), jnp.full((bq,), _M_INIT, jnp.float32),
          jnp.zeros((bq,), jnp.float32), jnp.zeros((bq,), jnp.float32))
  acc, m, l, count = lax.fori_loop(lo, hi, body, init)
  empty = l == 0.0                              # rows with no visible key (padding only)
  l_safe = jnp.where(empty, 1.0, l)
  o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(empty, 0.0, m + jnp.log(l_safe))
  if cfg.debug_counts:
    outs[2][...] = count


def _seg_args(q_seg, kv_seg):
  return () if q_seg is None else (q_seg, kv_seg)


def _forward(q, k, v, q_seg, kv_seg, cfg: _Cfg):
  """Padded inputs → (o [B,Sp,H,E], lse [B,H,Sp] fp32[, kv-block iteration counts [B,H,Sp]])."""
  B, Sp, H, E = q.shape
  Tp = k.shape[1]
  bq, G = cfg.block_q, cfg.groups
  has_seg = q_seg is not None
  in_specs = [pl.BlockSpec((_SQ, bq, _SQ, E), lambda b, h, i: (b, i, h, 0)),
              pl.BlockSpec((_SQ, Tp, _SQ, E), lambda b, h, i: (b, 0, h // G, 0)),
              pl.BlockSpec((_SQ, Tp, _SQ, E), lambda b, h, i: (b, 0, h // G, 0))]
  if has_seg:
    in_specs += [pl.BlockSpec((_SQ, bq), lambda b, h, i: (b, i)),
                 pl.BlockSpec((_SQ, Tp), lambda b, h, i: (b, 0))]
  row_spec = pl.BlockSpec((_SQ, _SQ, bq), lambda b, h, i: (b, h, i))
  out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype),
               jax.ShapeDtypeStruct((B, H, Sp), jnp.float32)]
  out_specs = [pl.BlockSpec((_SQ, bq, _SQ, E), lambda b, h, i: (b, i, h, 0)), row_spec]
  if cfg.debug_counts:
    out_shape.append(jax.ShapeDtypeStruct((B, H, Sp), jnp.float32))
    out_specs.append(row_spec)
  return pl.pallas_call(
      functools.partial(_fwd_kernel, cfg=cfg, has_seg=has_seg),
      grid=(B, H, cfg.num_q_blocks), in_specs=in_specs, out_specs=out_specs,
      out_shape=out_shape, compiler_params=compiler_params(E), interpret=cfg.interpret,
      name="flash_attention_fwd",
  )(q, k, v, *_seg_args(q_seg, kv_seg))


# ----------------------------------------------------------------------------- custom vjp
@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q, k, v, q_seg, kv_seg, cfg: _Cfg):
  return _forward(q, k, v, q_seg, kv_seg, cfg)[0]


def _flash_fwd(q, k, v, q_seg, kv_seg, cfg: _Cfg):
  o, lse = _forward(q, k, v, q_seg, kv_seg, cfg)[:2]
  o = checkpoint_name(o, "flash_out")
  lse = checkpoint_name(lse, "flash_lse")
  return o, (q, k, v, q_seg, kv_seg, o, lse)


def _flash_bwd(cfg: _Cfg, res, do):
  from MaxText.kernels.flash_attention_bwd import backward
  q, k, v, q_seg, kv_seg, o, lse = res
  dq, dk, dv = backward(q, k, v, q_seg, kv_seg, o, lse, do, cfg)
  return dq, dk, dv, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# ----------------------------------------------------------------------------- public wrapper
def _next_pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def check_inputs(q_BSHE, k_BTKE, v_BTKE, segment_ids_BS, sliding_window) -> None:
  """The shape contract the attention kernels share (ValueError naming what is wrong)."""
  B, S, H, E = q_BSHE.shape
  Bk, T, K, Ek = k_BTKE.shape
  if v_BTKE.shape != k_BTKE.shape or Bk != B or Ek != E:
    raise ValueError(f"shape mismatch: q {q_BSHE.shape}, k {k_BTKE.shape}, v {v_BTKE.shape}")
  if H % K:
    raise ValueError(f"num query heads {H} must be a multiple of num kv heads {K}")
  if segment_ids_BS is not None and (S != T or segment_ids_BS.shape != (B, S)):
    raise ValueError("segment_ids_BS must be [B, S] and needs S == T")
  if sliding_window is not None and sliding_window < 1:
    raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")


def _prepare(q_BSHE, k_BTKE, v_BTKE, segment_ids_BS, *, scale, causal, sliding_window,
             logit_softcap, block_q, block_kv, interpret, debug_counts=False):
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
  cfg = _Cfg(scale=float(scale), causal=bool(causal),
             window=None if sliding_window is None else int(sliding_window),
             softcap=None if logit_softcap is None else float(logit_softcap),
             block_q=bq, block_kv=bk, num_q_blocks=nq, num_kv_blocks=nk, kv_len=T,
             kv_padded=Tp != T, groups=H // K, interpret=bool(interpret), debug_counts=debug_counts)
  return q, k, v, q_seg, kv_seg, cfg


def flash_attention(q_BSHE, k_BTKE, v_BTKE, segment_ids_BS=None, *, scale: float,
                    causal: bool = True, sliding_window: int | None = None,
                    logit_softcap: float | None = None, block_q: int = 128, block_kv: int = 128,
                    interpret: bool | None = None):
  """Flash attention; same contract as `attention_ops.dot_product_attention` plus options.

  sliding_window=W: query i sees keys j > i - W (with causal: i - W < j <= i).
  logit_softcap=c: scores s -> c * tanh(s / c) before masking.
  interpret=None: interpret mode when the default backend is CPU.
  Returns [B, S, H, E] in q's dtype. Differentiable w.r.t. q, k, v (custom VJP, Pallas kernels).
  """
  S, E = q_BSHE.shape[1], q_BSHE.shape[3]
  q, k, v, q_seg, kv_seg, cfg = _prepare(
      q_BSHE, k_BTKE, v_BTKE, segment_ids_BS, scale=scale, causal=causal,
      sliding_window=sliding_window, logit_softcap=logit_softcap, block_q=block_q,
      block_kv=block_kv, interpret=interpret)
  o = _flash(q, k, v, q_seg, kv_seg, cfg)
  return o[:, :S, :, :E]


def flash_attention_debug_counts(q_BSHE, k_BTKE, v_BTKE, segment_ids_BS=None, **kwargs):
  """Forward only; returns (o, kv-block iterations run per query row [B, H, S]) for tests."""
  S, E = q_BSHE.shape[1], q_BSHE.shape[3]
  kwargs.setdefault("causal", True)
  for name, default in (("sliding_window", None), ("logit_softcap", None), ("block_q", 128),
                        ("block_kv", 128), ("interpret", None)):
    kwargs.setdefault(name, default)
  q, k, v, q_seg, kv_seg, cfg = _prepare(q_BSHE, k_BTKE, v_BTKE, segment_ids_BS,
                                         debug_counts=True, **kwargs)
  o, _, counts = _forward(q, k, v, q_seg, kv_seg, cfg)
  return o[:, :S, :, :E], counts[:, :, :S]
