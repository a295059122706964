"""What the flash-attention kernels share (MaxText/kernels/flash_attention.py: forward and the
public wrapper; flash_attention_bwd.py: the dq and dk/dv kernels): the static kernel config, the
block ranges the causal / window masks leave, the masked block scores, the Triton parameters and
the shape contract. Layouts and masks: see flash_attention.py."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

try:   # Triton compiler params also select the Triton lowering (not Mosaic GPU) on GPU
  from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover
  pltriton = None

SQ = getattr(pl, "squeezed", None)    # squeezed block dim (None on older jax)
MASK_VALUE = -1e30            # masked scores; finite so that no inf - inf appears
M_INIT = 0.5 * MASK_VALUE    # running-max start above MASK_VALUE: masked entries give exp(.) = 0


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Static configuration shared by all kernels (hashable: used as a nondiff argument)."""
  scale: float
  causal: bool
  window: int | None
  block_q: int
  block_kv: int
  num_q_blocks: int
  num_kv_blocks: int
  kv_len: int              # real (unpadded) kv length; keys at positions >= kv_len are masked
  kv_padded: bool
  groups: int              # G = H // K
  interpret: bool
  debug_counts: bool = False
  offsets: bool = False    # positions start at traced offsets (an int32 [2] input: q, kv)
  empty_lse: float = 0.0   # lse written for rows that see no key (the ring merge: MASK_VALUE)


# ----------------------------------------------------------------------------- block bounds
def _div(x, d: int):
  """Floor division of a non-negative python or traced int by a positive python int."""
  if isinstance(x, int):
    return x // d
  return lax.div(x, jnp.asarray(d, x.dtype))


def _floordiv(x, d: int):
  """Floor division by a positive python int of a python or traced int of any sign."""
  if isinstance(x, int):
    return x // d
  return jnp.floor_divide(x, jnp.asarray(d, x.dtype))


def _max(a, b):
  return max(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.maximum(a, b)


def _min(a, b):
  return min(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.minimum(a, b)


def kv_block_range(q_block, *, block_q: int, block_kv: int, num_kv_blocks: int, causal: bool,
                   window: int | None, shift=0):
  """[lo, hi) of the kv blocks that query block `q_block` can see (causal / window masks).
  `shift` (python or traced int): the queries' first position minus the keys' first position."""
  if not isinstance(shift, int) or shift:
    lo, hi = 0, num_kv_blocks
    q0 = q_block * block_q + shift             # first query, in key-index coordinates
    if window is not None:
      lo = _floordiv(_max(q0 - window + 1, 0), block_kv)
    if causal:
      hi = _max(_min(hi, _floordiv(q0 + block_q - 1, block_kv) + 1), 0)
    return _min(_min(lo, hi), num_kv_blocks), hi
  lo, hi = 0, num_kv_blocks
  if window is not None:                       # first query q0 sees keys > q0 - window
    lo = _div(_max(q_block * block_q - window + 1, 0), block_kv)
  if causal:                                   # last query sees keys <= itself
    hi = _min(hi, _div(q_block * block_q + block_q - 1, block_kv) + 1)
  return _min(lo, hi), hi


def q_block_range(kv_block, *, block_q: int, block_kv: int, num_q_blocks: int, causal: bool,
                  window: int | None, shift=0):
  """[lo, hi) of the query blocks that can see kv block `kv_block` (causal / window masks);
  `shift` as in `kv_block_range`."""
  if not isinstance(shift, int) or shift:
    lo, hi = 0, num_q_blocks
    k0 = kv_block * block_kv - shift           # first key, in query-index coordinates
    if causal:
      lo = _min(_floordiv(_max(k0, 0), block_q), num_q_blocks)
    if window is not None:
      hi = _max(_min(hi, _floordiv(k0 + block_kv - 1 + window - 1, block_q) + 1), 0)
    return _min(lo, hi), hi
  lo, hi = 0, num_q_blocks
  if causal:                                   # queries >= first key of the block
    lo = _div(kv_block * block_kv, block_q)
  if window is not None:                       # queries < last key + window
    hi = _min(hi, _div(kv_block * block_kv + block_kv - 1 + window - 1, block_q) + 1)
  return _min(lo, hi), hi


def compiler_params(head_dim: int):
  """Triton parameters (ignored in interpret mode); passing them forces the Triton lowering."""
  if pltriton is None:
    return None
  return pltriton.CompilerParams(num_warps=4 if head_dim <= 64 else 8, num_stages=2)


def dot(a, b, *, ta: bool = False, tb: bool = False):
  """2-D matmul with optional transposes, fp32 accumulation (full precision for fp32 inputs)."""
  dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
  precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _mask(q_pos, k_pos, q_seg, k_seg, cfg: KernelConfig, k0=0):
  """Boolean [bq, bk] mask (True = attend), or None when nothing is masked (`k0`: the first key's
  position, for the padding check)."""
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
    mask = conj(mask, jnp.broadcast_to(k_pos[None, :] - k0 < cfg.kv_len,
                                       (q_pos.shape[0], k_pos.shape[0])))
  return mask


def masked_scores(q, k, q_pos, k_pos, q_seg, k_seg, cfg: KernelConfig, k0=0):
  """Scaled scores [bq, bk] in fp32, MASK_VALUE where a query may not see a key."""
  s = dot(q, k, tb=True) * cfg.scale
  mask = _mask(q_pos, k_pos, q_seg, k_seg, cfg, k0)
  return s if mask is None else jnp.where(mask, s, MASK_VALUE)


def seg_args(q_seg, kv_seg):
  return () if q_seg is None else (q_seg, kv_seg)


def off_args(offsets):
  return () if offsets is None else (offsets,)


def kernel_refs(refs, *, n_in: int, has_seg: bool, has_off: bool):
  """Splits a kernel's refs: (the first `n_in` inputs, q_seg, kv_seg, offsets, outputs...);
  absent inputs are None."""
  refs = list(refs)
  ins, rest = refs[:n_in], refs[n_in:]
  qs = ks = off = None
  if has_seg:
    qs, ks, *rest = rest
  if has_off:
    off, *rest = rest
  return ins, qs, ks, off, rest


def start_positions(off_ref):
  """(first query position, first key position): 0, 0 or the traced offsets."""
  if off_ref is None:
    return 0, 0
  return off_ref[0], off_ref[1]


def check_inputs(q_BSHE, k_BTKE, v_BTKE, segment_ids_BS, sliding_window) -> None:
  """The shape contract the attention kernels share (ValueError naming what is wrong)."""
  B, S, H, E = q_BSHE.shape
  Bk, T, K, Ek = k_BTKE.shape
  if v_BTKE.shape != k_BTKE.shape or Bk != B or Ek != E:
    raise ValueError(f"shape mismatch: q {q_BSHE.shape}, k {k_BTKE.shape}, v {v_BTKE.shape}")
  if H % K:
    raise ValueError(f"num query heads {H} must be a multiple of num kv heads {K}")
  if segment_ids_BS is not None and (S != T or segment_ids_BS.shape != (B, S)):
    raise ValueError("segment_ids_BS must be [B, S] and needs S == T (else pass kv_segment_ids)")
  if sliding_window is not None and sliding_window < 1:
    raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")


