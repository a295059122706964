"""`attention=flash` on TPU: JAX's splash-attention Pallas kernel behind our op signature.

Layouts as in `MaxText.layers.attention_ops`: q [B,S,H,E], k/v [B,T,K,E], H % K == 0, segment ids
[B,S] (equal ids attend; S == T). The splash kernel works per batch row on [H,S,E] / [K,T,E] (it is
vmapped over B); GQA: query head h reads kv head h // (H/K) inside the kernel (its multi-head
kernel groups the query heads of a kv head), so K/V are never repeated.

Masks are splash's lazy masks, so fully masked blocks are skipped: `CausalMask`; a sliding window
W (query i sees keys i - W < j, and j <= i when causal) is `LocalMask(window_size=(W - 1, 0 or
None))`; packed documents are `SegmentIds`. The kernel has no scale argument: q is multiplied by
`scale` first.

Shapes the kernel does not take directly are padded here, so the op accepts what our GPU kernel
accepts:
- splash blocks are multiples of 128 (the TPU lane width; with segment ids both the q and the kv
  block must be) and must divide the sequence. Sequences are padded to a multiple of 128 (padded
  keys get a segment id no query has, padded query rows are cut off again) and the block used is
  the largest multiple of 128 that is <= max(128, block_q) (block_kv) and divides the padded length.
- head dims that are not a multiple of 128 are zero-padded to one (zero columns change no score
  and the padded output columns are cut off). JAX's own TPU tests also run 64 and 192 unpadded;
  128-aligned tiles are simply the layout every TPU generation takes, at the price of idle lanes
  for small head dims (not measured: no TPU was available). The same padding runs on CPU, so the
  tests cover it.

Runs with `interpret=True` on CPU (the default when the backend is CPU) so tests check it there.
API: the splash module of jax 0.10.2 ... 0.12 (`make_splash_mha`, `BlockSizes`, `SegmentIds`,
`CausalMask`, `LocalMask`, `FullMask`, `MultiHeadMask`); optional keywords of `make_splash_mha`
(`residual_checkpoint_name`) are passed only when its signature has them.
"""
from __future__ import annotations

import functools
import inspect
from typing import cast

import jax
import jax.numpy as jnp

from MaxText.kernels.flash_common import check_inputs

LANES = 128                      # splash blocks are multiples of this; S, T and E are padded to it
RESIDUAL_NAME = "splash_residuals"   # checkpoint_name of the kernel's saved out / logsumexp


def _module():
  """The splash-attention module, or an ImportError that says which jax lacks it."""
  try:
    from jax.experimental.pallas.ops.tpu import splash_attention as sa
  except ImportError as e:   # pragma: no cover - every jax this project supports has it
    raise ImportError(f"jax {jax.__version__} has no jax.experimental.pallas.ops.tpu."
                      f"splash_attention; attention=flash on TPU needs it") from e
  return sa


def available() -> bool:
  try:
    _module()
  except ImportError:
    return False
  return True


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def fit_block(length: int, block: int) -> int:
  """The splash block used for a (padded, multiple of 128) length: the largest multiple of 128
  that is <= max(128, block) and divides `length`."""
  b = min(max(LANES, block // LANES * LANES), length)
  while length % b:
    b -= LANES
  return b


def padded_length(length: int) -> int:
  return _round_up(length, LANES)


def _accepts(fn, name: str) -> bool:
  try:
    return name in inspect.signature(fn).parameters
  except (TypeError, ValueError):   # pragma: no cover
    return False


# The backward's blocks for heads wider than one lane tile: at most this many rows. Its kernels
# keep q, k, v, do and the dq / dk / dv accumulators of a block pair in the TPU's scoped VMEM
# (16 MiB by default): at head_dim 256 with blocks of 1024 inside a model (Qwen3-Next's gated
# attention: 17.56 MiB) and at 512 alone (Gemma 4's global heads: 17.14 MiB) the compile fails
# (XLA error E1001, found by compiling for a v5e: benchmarks/tpu_aot.py); 512-row blocks fit.
WIDE_HEAD_BWD_BLOCK = 512


def backward_block(block: int, head_dim_padded: int, length: int) -> int:
  """The backward kernels' block for a forward block `block` (already fitted to `length`)."""
  if head_dim_padded <= LANES or block <= WIDE_HEAD_BWD_BLOCK:
    return block
  return fit_block(length, WIDE_HEAD_BWD_BLOCK)


@functools.lru_cache(maxsize=64)
def _kernel(H: int, S: int, T: int, causal: bool, window: int | None, bq: int, bkv: int,
            interpret: bool, fused_bwd: bool, bq_bwd: int, bkv_bwd: int):
  """Builds (and caches) the kernel: mask processing is NumPy work over all blocks. Built eagerly
  (`ensure_compile_time_eval`) so its mask-info arrays are concrete constants, never tracers of
  the trace that first asked for it (a cached tracer would leak into the next trace)."""
  with jax.ensure_compile_time_eval():
    return _build_kernel(H, S, T, causal, window, bq, bkv, interpret, fused_bwd, bq_bwd, bkv_bwd)


def _build_kernel(H: int, S: int, T: int, causal: bool, window: int | None, bq: int, bkv: int,
                  interpret: bool, fused_bwd: bool, bq_bwd: int, bkv_bwd: int):
  """The splash kernel: forward blocks bq x bkv, the backward's bq_bwd x bkv_bwd
  (`backward_block`)."""
  sa = _module()
  if window is not None:
    mask = sa.LocalMask((S, T), window_size=(window - 1, 0 if causal else None), offset=0)
  elif causal:
    mask = sa.CausalMask((S, T))
  else:
    mask = sa.FullMask((S, T))
  # the fused backward computes dq beside dk / dv in one kernel (no dq blocks of its own)
  blocks = sa.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv,
                         block_q_dkv=bq_bwd, block_kv_dkv=bkv_bwd, block_kv_dkv_compute=bkv_bwd,
                         block_q_dq=None if fused_bwd else bq_bwd,
                         block_kv_dq=None if fused_bwd else bkv_bwd,
                         use_fused_bwd_kernel=fused_bwd)
  heads_mask = sa.MultiHeadMask([mask] * H)
  if _accepts(sa.make_splash_mha, "residual_checkpoint_name"):
    return sa.make_splash_mha(heads_mask, block_sizes=blocks, head_shards=1, q_seq_shards=1,
                              interpret=interpret, residual_checkpoint_name=RESIDUAL_NAME)
  return sa.make_splash_mha(heads_mask, block_sizes=blocks, head_shards=1, q_seq_shards=1,
                            interpret=interpret)


def splash_attention(q_BSHE, k_BTKE, v_BTKE, segment_ids_BS=None, *, scale: float,
                     causal: bool = True, sliding_window: int | None = None,
                     block_q: int = 512, block_kv: int = 512,
                     interpret: bool | None = None, fused_bwd: bool = False) -> jax.Array:
  """Splash attention with the contract of `attention_ops.dot_product_attention`.
  interpret=None: interpret mode when the default backend is CPU."""
  sa = _module()
  check_inputs(q_BSHE, k_BTKE, v_BTKE, segment_ids_BS, sliding_window)
  B, S, H, E = q_BSHE.shape
  T = k_BTKE.shape[1]
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  Sp, Tp = padded_length(S), padded_length(T)
  Ep = _round_up(E, LANES)
  bq, bkv = fit_block(Sp, block_q), fit_block(Tp, block_kv)

  if scale != 1.0:
    q_BSHE = (q_BSHE * scale).astype(q_BSHE.dtype)
  q = jnp.pad(q_BSHE, ((0, 0), (0, Sp - S), (0, 0), (0, Ep - E))).transpose(0, 2, 1, 3)
  k = jnp.pad(k_BTKE, ((0, 0), (0, Tp - T), (0, 0), (0, Ep - E))).transpose(0, 2, 1, 3)
  v = jnp.pad(v_BTKE, ((0, 0), (0, Tp - T), (0, 0), (0, Ep - E))).transpose(0, 2, 1, 3)
  kernel = _kernel(H, Sp, Tp, bool(causal), None if sliding_window is None else int(sliding_window),
                   bq, bkv, bool(interpret), bool(fused_bwd), backward_block(bq, Ep, Sp),
                   backward_block(bkv, Ep, Tp))
  if segment_ids_BS is None and Tp == T:
    out = jax.vmap(kernel)(q, k, v)
  else:   # padded queries get -1, padded keys -2: no real (>= 0) or padded query matches them
    if segment_ids_BS is None:          # padded keys still need masking: real ids all 0
      q_seg, kv_seg = jnp.zeros((B, S), jnp.int32), jnp.zeros((B, T), jnp.int32)
    else:
      q_seg = kv_seg = segment_ids_BS.astype(jnp.int32)
    q_seg = jnp.pad(q_seg, ((0, 0), (0, Sp - S)), constant_values=-1)
    kv_seg = jnp.pad(kv_seg, ((0, 0), (0, Tp - T)), constant_values=-2)
    out = jax.vmap(lambda q, k, v, qs, ks: kernel(q, k, v, segment_ids=sa.SegmentIds(q=qs, kv=ks)))(
        q, k, v, q_seg, kv_seg)
  out = cast(jax.Array, out)   # (typed output-or-residuals; without save_residuals: the output)
  return out.transpose(0, 2, 1, 3)[:, :S, :, :E]
