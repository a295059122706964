"""Attention kernels behind the `attention` key. All take q[B,S,H,E], k/v[B,T,K,E] with H % K == 0
(GQA without repeating K/V), segment ids [B,S] (0 = padding) and return [B,S,H,E]."""
from __future__ import annotations

import functools
from typing import Literal, TypedDict

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from MaxText.backend import hot_path
from MaxText.kernels import splash as splash_kernel
from MaxText.layers import sites
from MaxText.kernels.flash_attention import flash_attention
from MaxText.layers.context_parallel import flash_context_parallel
from MaxText.layers.attention_lowp import attention_core
from MaxText.layers.linear import row_major
from MaxText.sharding.rules import current_context, logical_to_spec


# Causal attention in query blocks of this many positions, each over the keys up to its end
# (none after it), at most MAX_QUERY_BLOCKS: at S = 2·QUERY_BLOCK the scores are 3/4 of S x S, from
# 4·QUERY_BLOCK on 5/8; each block is a dot of its own, so more blocks stop paying (an A/B with
# benchmarks/ab_step.py chose 4 over 2).
QUERY_BLOCK = 64
MAX_QUERY_BLOCKS = 4
# On the XLA:CPU-tuned path shorter sequences run as one block: below this the keys a causal block
# skips are a small part of a small step, while every block adds slices, dots and concatenations
# of its own to the forward and backward pass, which XLA:CPU compiles as one kernel per distinct
# fusion (benchmarks/RESULTS.md, "Compile time vs MaxText").
MIN_BLOCKED_LENGTH = 256


class FlashOptions(TypedDict):
  """The flash kernel's options, passed alike to the kernel and to its context-parallel form."""
  scale: float
  causal: bool
  sliding_window: int | None
  block_q: int
  block_kv: int


def causal_query_blocks(S: int, T: int, G: int, sliding_window: int | None):
  """Row blocks of the folded queries (row s·G + g ↔ query s, head g of its kv head) and the keys
  each needs under a causal mask (and a window W: keys s − W < t ≤ s), as `attention_core` takes
  them; None: one block over every key (short sequences, or T ≠ S)."""
  n = min(S // QUERY_BLOCK, MAX_QUERY_BLOCKS)
  if n < 2 or S != T:
    return None
  ends = [S * (i + 1) // n for i in range(n)]
  starts = [0, *ends[:-1]]
  return tuple((s0 * G, s1 * G, 0 if sliding_window is None else max(0, s0 - sliding_window + 1),
                s1) for s0, s1 in zip(starts, ends))


def _heads_major(x_BKQT, K: int, G: int):
  """[B, K, S·G, T] (rows s·G + g) → [B, H, S, T] (head h = k·G + g), for the inspection sites
  (through rank-4 intermediates: no other value looks like a layer stack of patterns)."""
  B, _, Q, T = x_BKQT.shape
  return x_BKQT.reshape(B * K, Q // G, G, T).transpose(0, 2, 1, 3).reshape(B, K * G, Q // G, T)


def _rows_major(x_BHST, K: int, G: int):
  """The inverse of `_heads_major`."""
  B, _, S, T = x_BHST.shape
  return x_BHST.reshape(B * K, G, S, T).transpose(0, 2, 1, 3).reshape(B, K, S * G, T)


def _plain_attention(q_BKQE, k_BKTE, v_BKTE, mask_BQT, scale, blocks, probe):
  """The autodiff path (fp32, the plain hot path, or under a probe), block by block as
  `attention_core`."""
  Q, T = q_BKQE.shape[2], k_BKTE.shape[2]
  outs = []
  for r0, r1, t0, t1 in blocks or ((0, Q, 0, T),):
    scores = jnp.einsum("bkqe,bkte->bkqt", q_BKQE[:, :, r0:r1], k_BKTE[:, :, t0:t1],
                        preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask_BQT[:, None, r0:r1, t0:t1], scores, jnp.finfo(jnp.float32).min)
    scores = probe("attn_scores", scores)
    probs = probe("attn_pattern", jax.nn.softmax(scores, axis=-1)).astype(v_BKTE.dtype)
    outs.append(jnp.einsum("bkqt,bkte->bkqe", probs, v_BKTE[:, :, t0:t1]))
  return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=2)


def dot_product_attention(q_BSHE, k_BTKE, v_BTKE, segment_ids_BS, *, scale: float,
                          causal: bool = True, sliding_window: int | None = None,
                          blocks_BS: jax.Array | None = None) -> jax.Array:
  """Materialises the scores: softmax in fp32, masks for causality and packed documents.
  `blocks_BS` (causal only; S = T): tokens of one block id >= 0 also attend to each other both
  ways (an image's soft tokens; transformers' blockwise overlay), the window's lower bound kept.

  Heads-major layout: the G = H/K query heads that share one kv head are folded into the query
  length (Q = S·G rows per kv head, row s·G + g), so both matmuls are plain batched [Q,E]x[E,T]
  products over (B, K) — the layout XLA handles best, and K/V are never repeated. Causal, the
  queries run in blocks (`causal_query_blocks`) that skip the keys after their end.
  """
  B, S, H, E = q_BSHE.shape
  T, K = k_BTKE.shape[1], k_BTKE.shape[2]
  G = H // K
  q_BKQE = q_BSHE.reshape(B, S, K, G, E).transpose(0, 2, 1, 3, 4).reshape(B, K, S * G, E)
  k_BKTE, v_BKTE = k_BTKE.transpose(0, 2, 1, 3), v_BTKE.transpose(0, 2, 1, 3)
  mask_BST = segment_ids_BS[:, :, None] == segment_ids_BS[:, None, :]
  if causal:
    causal_BST = jnp.tril(jnp.ones((S, T), jnp.bool_))[None]
    if blocks_BS is not None:
      causal_BST = causal_BST | ((blocks_BS[:, :, None] == blocks_BS[:, None, :])
                                 & (blocks_BS[:, :, None] >= 0))
    mask_BST &= causal_BST
  if sliding_window is not None:                                # keys q - W < k (<= q if causal)
    mask_BST &= (jnp.arange(T)[None, :] > jnp.arange(S)[:, None] - sliding_window)[None]
  mask_BQT = jnp.repeat(mask_BST, G, axis=1)                    # row s*G + g ↔ (query s, head g)
  probed = sites.active() is not None
  blocks = (causal_query_blocks(S, T, G, sliding_window)
            if causal and not probed and blocks_BS is None else None)
  # bf16 on the XLA:CPU-tuned hot path: every dot in bf16 (attention_lowp.py); on the plain path
  # (GPU, TPU) and under a probe (its sites) the autodiff path below
  out_BKQE: jax.Array
  if jnp.dtype(q_BSHE.dtype).itemsize < 4 and not probed and hot_path.tuned():
    out_BKQE = attention_core(row_major(q_BKQE), row_major(k_BKTE), row_major(v_BKTE),
                              mask_BQT[:, None], scale, blocks if S >= MIN_BLOCKED_LENGTH else None)
  else:
    # inspection sites (layers/sites.py) see [B, H, S, T], head h = k·G + g
    probe = ((lambda name, x: _rows_major(sites.site(name, _heads_major(x, K, G)), K, G))
             if probed else (lambda name, x: x))
    out_BKQE = _plain_attention(q_BKQE, k_BKTE, v_BKTE, mask_BQT, scale, blocks, probe)
  return out_BKQE.reshape(B, K, S, G, E).transpose(0, 2, 1, 3, 4).reshape(B, S, H, E)


def _per_shard(name: str, run, q_BSHE, k_BTKE, v_BTKE, segment_ids_BS,
               context_parallel=None) -> jax.Array:
  """Runs `run(q, k, v, segment_ids)` (a kernel that sees whole arrays) once per shard under a mesh
  (`use_rules`), through `shard_map`: batch over the `activation_batch` axes, heads over the
  `activation_heads` axes when the kv heads split the same way (else heads stay whole). A sequence
  split over the context axis goes to `context_parallel(q, k, v, segment_ids, ctx=, batch=,
  heads=, kv_heads=)` (flash: layers/context_parallel.py); the other kernels refuse it (config
  validation refuses it first). Outside a mesh: `run` on the whole arrays."""
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
    if context_parallel is None:
      raise ValueError(f"attention={name} does not support a sharded sequence (context "
                       f"parallelism)")
    return context_parallel(q_BSHE, k_BTKE, v_BTKE, segment_ids_BS, ctx=ctx, batch=batch,
                            heads=heads, kv_heads=kv_heads)
  q_spec, kv_spec = P(batch, None, heads, None), P(batch, None, kv_heads, None)
  return jax.shard_map(run, mesh=ctx.mesh, in_specs=(q_spec, kv_spec, kv_spec, P(batch, None)),
                       out_specs=q_spec, check_vma=False)(q_BSHE, k_BTKE, v_BTKE, segment_ids_BS)


def flash(q_BSHE, k_BTKE, v_BTKE, segment_ids_BS, *, scale: float, causal: bool = True,
          sliding_window: int | None = None, block_q: int = 512, block_kv: int = 512,
          context_strategy: str = "all_gather") -> jax.Array:
  """Our Pallas flash-attention kernel (MaxText/kernels/flash_attention.py), per shard; a sequence
  split over the context axis by `context_strategy` (layers/context_parallel.py)."""
  kw: FlashOptions = {"scale": scale, "causal": causal, "sliding_window": sliding_window,
                      "block_q": block_q, "block_kv": block_kv}

  def run(q, k, v, seg):
    return flash_attention(q, k, v, seg, **kw)

  cp = functools.partial(flash_context_parallel, strategy=context_strategy, **kw)
  return _per_shard("flash", run, q_BSHE, k_BTKE, v_BTKE, segment_ids_BS, context_parallel=cp)


def splash(q_BSHE, k_BTKE, v_BTKE, segment_ids_BS, *, scale: float, causal: bool = True,
           sliding_window: int | None = None, block_q: int = 512, block_kv: int = 512,
           fused_bwd: bool = False) -> jax.Array:
  """`attention=flash` on TPU: JAX's splash-attention kernel (MaxText/kernels/splash.py), per
  shard; interpret mode on CPU."""
  def run(q, k, v, seg):
    return splash_kernel.splash_attention(q, k, v, seg, scale=scale, causal=causal,
                                          sliding_window=sliding_window, block_q=block_q,
                                          block_kv=block_kv, fused_bwd=fused_bwd)

  return _per_shard("flash (splash)", run, q_BSHE, k_BTKE, v_BTKE, segment_ids_BS)


def cudnn(q_BSHE, k_BTKE, v_BTKE, segment_ids_BS, *, scale: float, causal: bool = True,
          sliding_window: int | None = None,
          implementation: Literal["xla", "cudnn"] = "cudnn") -> jax.Array:
  """`jax.nn.dot_product_attention(implementation="cudnn")` (cuDNN's fused flash attention), per
  shard. Masks through its arguments: `is_causal`; a window W (keys q - W < k <= q) as
  `local_window_size=(W - 1, 0)` (cuDNN takes a left window only, so it needs causal); packed
  documents as a boolean `mask` [B, 1, S, T] of equal segment ids — that API has no segment-id
  argument, and cuDNN turns the mask into an additive bias, so packed rows cost O(S²) memory per
  sequence here. `implementation="xla"` runs the same call on any platform (tests)."""
  window = None
  if sliding_window is not None:
    if not causal:
      raise ValueError("attention=cudnn: a sliding window needs causal attention (cuDNN takes a "
                       "left window only)")
    window = (sliding_window - 1, 0)

  def run(q, k, v, seg):
    mask = None if seg is None else (seg[:, None, :, None] == seg[:, None, None, :])
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, is_causal=causal,
                                        local_window_size=window, implementation=implementation)

  return _per_shard("cudnn", run, q_BSHE, k_BTKE, v_BTKE, segment_ids_BS)


# Resolved op names (`ModelConfig.attention`) → functions. `splash` is not a config choice: it is
# what `flash` (and `autoselected`) resolve to on TPU.
ATTENTION_OPS = {"dot_product": dot_product_attention, "flash": flash, "splash": splash,
                 "cudnn": cudnn}
BLOCK_SIZED_OPS = ("flash", "splash")      # take the flash_block_q / flash_block_kv keys
GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def select_attention(name: str, platform: str) -> str:
  """The `attention` key → the op that runs, for a platform (the one place that decides):
  flash → our Pallas kernel, or splash on TPU; autoselected → flash on GPUs, splash on TPU, the
  XLA dot-product path elsewhere (on CPU the kernels only run in the slow Pallas interpreter);
  dot_product and cudnn as they are (cudnn off NVIDIA GPUs is refused by `attention_problems`)."""
  if name == "autoselected":
    name = "flash" if platform in GPU_PLATFORMS or platform == "tpu" else "dot_product"
  if name == "flash" and platform == "tpu":
    return "splash"
  return name


def attention_op(mcfg):
  """The attention function a model layer calls, with the block sizes bound (`mcfg` is a
  `ModelConfig` whose `attention` is resolved)."""
  op = ATTENTION_OPS[mcfg.attention]
  if mcfg.attention in BLOCK_SIZED_OPS:
    op = functools.partial(op, block_q=mcfg.flash_block_q, block_kv=mcfg.flash_block_kv)
  if mcfg.attention == "flash":
    op = functools.partial(op, context_strategy=mcfg.context_parallel_strategy)
  if mcfg.attention == "splash":
    op = functools.partial(op, fused_bwd=mcfg.flash_fused_bwd)
  return op


def _cudnn_problem(device, dtype: str, head_dims: list[int]) -> str | None:
  """Why cuDNN's fused attention cannot run this config on `device` (None: it can), following the
  checks JAX's cuDNN lowering makes. A CUDA device is the CUDA plug-in, which ships cuDNN."""
  platform = device.platform
  version = getattr(getattr(device, "client", None), "platform_version", "") or ""
  if platform not in GPU_PLATFORMS or "rocm" in version.lower():
    return (f"attention=cudnn needs an NVIDIA GPU with cuDNN; this run's devices are "
            f"{platform!r} ({device.device_kind}). Use attention=flash or attention=dot_product")
  if dtype not in ("bfloat16", "float16"):
    return (f"attention=cudnn needs dtype bfloat16 or float16 (cuDNN flash attention has no "
            f"float32 path), got dtype={dtype}")
  cc = getattr(device, "compute_capability", None)
  try:
    hopper = tuple(int(x) for x in str(cc).split(".")) >= (9, 0)
  except ValueError:
    hopper = True
  limit = 256 if hopper else 128
  bad = [e for e in head_dims if e > limit or e % 8]
  if bad:
    return (f"attention=cudnn supports head dims that are multiples of 8 up to {limit} on this GPU "
            f"(compute capability {cc}); the model has {bad}. Use attention=flash")
  return None


def attention_problems(requested: str, resolved: str, *, device, dtype: str, head_dims: list[int],
                       sequence_sharded: bool) -> list[tuple[str, str]]:
  """Config-time refusals of the resolved op (→ ConfigError, exit 2, before anything compiles)."""
  problems = []
  if resolved in ("splash", "cudnn") and sequence_sharded:
    how = "" if requested == resolved else f" (attention={requested} on {device.platform})"
    problems.append(("attention", f"the {resolved} kernel{how} runs on whole sequences per "
                     f"shard; a sequence sharded over the context axis (context parallelism) "
                     f"needs attention=flash (our Pallas kernel, on GPU / CPU) or dot_product"))
  if resolved == "cudnn":
    problem = _cudnn_problem(device, dtype, head_dims)
    if problem:
      problems.append(("attention", problem))
  if resolved == "splash":
    if not splash_kernel.available():
      problems.append(("attention", f"attention=flash on TPU runs JAX's splash attention, which "
                       f"this jax ({jax.__version__}) does not have"))
  return problems
