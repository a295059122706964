"""Pallas flash attention (CPU interpret mode) vs plain-jnp references: outputs and dq/dk/dv."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

from MaxText.kernels.flash_attention import (_prepare, flash_attention, flash_attention_debug_counts,
                                             kv_block_range, q_block_range, triton_max_block)
from MaxText.layers.attention_ops import dot_product_attention


def _visible(B, S, T, segment_ids_BS, causal, sliding_window, xp):
  """[B, S, T] bool: the keys each query may see (`xp`: numpy or jax.numpy)."""
  i, j = xp.arange(S)[:, None], xp.arange(T)[None, :]
  mask = xp.ones((B, S, T), bool)
  if causal:
    mask = mask & (j <= i)[None]
  if sliding_window is not None:
    mask = mask & (j > i - sliding_window)[None]
  if segment_ids_BS is not None:
    mask = mask & (segment_ids_BS[:, :, None] == segment_ids_BS[:, None, :])
  return mask


def _ref_attention(q_BSHE, k_BTKE, v_BTKE, segment_ids_BS, *, scale, causal=True,
                   sliding_window=None):
  """Materialised attention in fp32 with every option of the kernel (K/V repeated: test only)."""
  B, S, H, E = q_BSHE.shape
  T, K = k_BTKE.shape[1], k_BTKE.shape[2]
  q, k, v = (x.astype(jnp.float32) for x in (q_BSHE, k_BTKE, v_BTKE))
  k, v = jnp.repeat(k, H // K, axis=2), jnp.repeat(v, H // K, axis=2)
  s = jnp.einsum("bshe,bthe->bhst", q, k, precision="highest") * scale
  mask = _visible(B, S, T, segment_ids_BS, causal, sliding_window, jnp)
  s = jnp.where(mask[:, None], s, jnp.finfo(jnp.float32).min)
  p = jax.nn.softmax(s, axis=-1)
  return jnp.einsum("bhst,bthe->bshe", p, v, precision="highest")


@functools.partial(jax.jit, static_argnames=("B", "S", "T", "H", "K", "E", "dtype"))
def _inputs(B, S, T, H, K, E, dtype=jnp.float32, seed=0):
  """q, k, v and a cotangent, drawn in one program (eagerly each draw and cast compiles alone)."""
  kq, kk, kv, kd = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(kq, (B, S, H, E), jnp.float32).astype(dtype)
  k = jax.random.normal(kk, (B, T, K, E), jnp.float32).astype(dtype)
  v = jax.random.normal(kv, (B, T, K, E), jnp.float32).astype(dtype)
  do = 0.5 * jax.random.normal(kd, (B, S, H, E), jnp.float32)
  return q, k, v, do


# Interpret-mode kernels are compile-bound on CPU: a cheap XLA backend pass halves the test time.
_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _compiled(fn, *args):
  """fn compiled and run; float32 matmuls at full precision on every platform (a GPU's default
  would run the XLA reference's in TF32, ~1e-3 relative, beside a kernel that asks for full)."""
  options = _FAST_COMPILE if jax.default_backend() == "cpu" else {}
  with jax.default_matmul_precision("highest"):
    return jax.jit(fn).lower(*args).compile(compiler_options=options)(*args)


def _magnitudes(q, k, v, do, segment_ids, *, scale, causal=True, sliding_window=None):
  """Float64: for each of o, dq, dk, dv the largest sum of |terms| of its last reduction
  (o = sum_t p v, dq = scale sum_t dS k, dk = scale sum_s dS q, dv = sum_s p do, dk/dv summed
  over the query heads sharing a kv head) and that reduction's length plus the head dim."""
  q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
  B, S, H, E = q.shape
  T, K = k.shape[1], k.shape[2]
  k, v = np.repeat(k, H // K, 2), np.repeat(v, H // K, 2)
  s = np.einsum("bshe,bthe->bhst", q, k) * scale
  seg = None if segment_ids is None else np.asarray(segment_ids)
  s = np.where(_visible(B, S, T, seg, causal, sliding_window, np)[:, None], s, -np.inf)
  p = np.exp(s - np.max(s, -1, keepdims=True, initial=-1e300))
  p = p / np.maximum(p.sum(-1, keepdims=True), 1e-300)
  o = np.einsum("bhst,bthe->bshe", p, v)
  ds = p * (np.einsum("bshe,bthe->bhst", do, v) - np.einsum("bshe,bshe->bhs", do, o)[..., None])
  ds = np.abs(ds)
  group = lambda x: x.reshape(B, T, K, H // K, E).sum(3)
  return {"o": (np.einsum("bhst,bthe->bshe", p, np.abs(v)).max(), T + E),
          "dq": (scale * np.einsum("bhst,bthe->bshe", ds, np.abs(k)).max(), T + E),
          "dk": (scale * group(np.einsum("bhst,bshe->bthe", ds, np.abs(q))).max(), S * H // K + E),
          "dv": (group(np.einsum("bhst,bshe->bthe", p, np.abs(do))).max(), S * H // K + E)}


def tolerance(dtype, magnitude: float, n: int) -> float:
  """Rounding allowed between two correct implementations: about two roundings at the array
  dtype (inputs/outputs and the probabilities cast for the matmuls, eps/2 each, twice: forward and
  backward) and fp32 accumulation over the n-term reductions, whose rounding grows like sqrt(n) for
  these random inputs, all relative to the magnitude (sum of |terms|) of the result."""
  eps, eps32 = float(jnp.finfo(dtype).eps), float(jnp.finfo(jnp.float32).eps)
  return magnitude * (2 * eps + np.sqrt(n) * eps32)


def _compare(flash_fn, ref_fn, q, k, v, do, *, segment_ids, scale, ref_inputs=None, **mask):
  """Output and vjp (random cotangent) of the kernel vs the reference, in one compiled program;
  each within `tolerance` of its magnitude (`mask`: causal, sliding_window)."""
  def run(q, k, v, rq, rk, rv, do):
    o, vjp = jax.vjp(flash_fn, q, k, v)
    ro, rvjp = jax.vjp(ref_fn, rq, rk, rv)
    return (o, *vjp(do.astype(o.dtype))), (ro, *rvjp(do.astype(ro.dtype)))
  got, want = _compiled(run, q, k, v, *(ref_inputs or (q, k, v)), do)
  sizes = _magnitudes(*(ref_inputs or (q, k, v)), do.astype(q.dtype), segment_ids, scale=scale,
                      **mask)
  for name, g, w in zip(("o", "dq", "dk", "dv"), got, want):
    assert g.shape == w.shape, (name, g.shape, w.shape)
    assert g.dtype == q.dtype, (name, g.dtype)
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    assert np.all(np.isfinite(g)), name
    assert np.abs(w).max() > 0.05, (name, "reference is trivially small")
    tol = tolerance(q.dtype, *sizes[name])
    assert tol < 0.05 * np.abs(w).max(), (name, "tolerance is not tight", tol)
    err = np.abs(g - w).max()
    assert err <= tol, f"{name}: max abs err {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("H,K,causal,block_q,block_kv", [
    (4, 2, True, 32, 64),     # GQA, causal, block_q != block_kv
    (4, 1, False, 64, 32),    # MQA, non-causal
])
def test_matches_dot_product_attention(H, K, causal, block_q, block_kv):
  B, S, E = 2, 128, 32
  q, k, v, do = _inputs(B, S, S, H, K, E)
  seg = np.ones((B, S), np.int32)
  scale = E ** -0.5
  _compare(lambda q, k, v: flash_attention(q, k, v, seg, scale=scale, causal=causal,
                                           block_q=block_q, block_kv=block_kv),
           lambda q, k, v: dot_product_attention(q, k, v, seg, scale=scale, causal=causal),
           q, k, v, do, segment_ids=seg, scale=scale, causal=causal)


def test_segment_ids_packed_documents():
  B, S, H, K, E = 2, 96, 2, 2, 32
  q, k, v, do = _inputs(B, S, S, H, K, E, seed=1)
  # batch 0: two documents split at 50; batch 1: split at 17 and a padding tail (id 0)
  pos = np.arange(S)
  seg = np.stack([np.where(pos < 50, 1, 2), np.where(pos < 17, 1, np.where(pos < 80, 2, 0))])
  seg = seg.astype(np.int32)
  scale = E ** -0.5
  _compare(lambda q, k, v: flash_attention(q, k, v, seg, scale=scale, block_q=32, block_kv=32),
           lambda q, k, v: dot_product_attention(q, k, v, seg, scale=scale), q, k, v, do,
           segment_ids=seg, scale=scale)


@pytest.mark.parametrize("kwargs,shape", [
    (dict(sliding_window=40, block_q=32, block_kv=32), (1, 128, 128, 4, 2, 32)),
    (dict(scale=1.0, block_q=64, block_kv=32), (1, 64, 64, 2, 1, 64)),
    # ragged S=T=100 with blocks of 32, a window that leaves padded query rows with no key,
    # segment ids and a head dim (48) that is padded to a power of two
    (dict(sliding_window=20, block_q=32, block_kv=32, segments=True), (1, 100, 100, 2, 2, 48)),
    # ragged and S != T, non-causal: padded keys must be masked by the kernel itself
    (dict(causal=False, block_q=32, block_kv=32), (2, 100, 72, 2, 1, 32)),
])
def test_options_match_reference(kwargs, shape):
  B, S, T, H, K, E = shape
  kwargs = dict(kwargs)
  q, k, v, do = _inputs(B, S, T, H, K, E, seed=2)
  seg = None
  if kwargs.pop("segments", False):
    seg = np.broadcast_to(np.where(np.arange(S) < 60, 3, 4), (B, S)).astype(np.int32)
  if kwargs.pop("scale", None) == 1.0:
    scale, q = 1.0, q * E ** -0.5          # scale=1.0 with pre-scaled q: logits stay ~1
  else:
    scale = E ** -0.5
  ref_kw = {n: kwargs[n] for n in ("causal", "sliding_window") if n in kwargs}
  _compare(lambda q, k, v: flash_attention(q, k, v, seg, scale=scale, **kwargs),
           lambda q, k, v: _ref_attention(q, k, v, seg, scale=scale, **ref_kw), q, k, v, do,
           segment_ids=seg, scale=scale, **ref_kw)


def test_reference_options_are_active():
  """The window reference differs from plain causal attention (tests can fail)."""
  q, k, v, _ = _inputs(1, 64, 64, 2, 2, 32)
  base, window = _compiled(lambda q, k, v: [
      _ref_attention(q, k, v, None, scale=1.0, **kw)
      for kw in (dict(), dict(sliding_window=16))], q, k, v)
  assert np.abs(window - base).max() > 1e-2


def test_bf16_inputs():
  B, S, H, K, E = 1, 128, 4, 2, 64
  q, k, v, do = _inputs(B, S, S, H, K, E, dtype=jnp.bfloat16, seed=3)
  scale = E ** -0.5
  f32 = tuple(np.asarray(x, np.float32) for x in (q, k, v))   # exact: bf16 -> fp32 on the host
  _compare(lambda q, k, v: flash_attention(q, k, v, None, scale=scale, sliding_window=64,
                                           block_q=32, block_kv=64),
           lambda q, k, v: _ref_attention(q, k, v, None, scale=scale, sliding_window=64),
           q, k, v, do, segment_ids=None, scale=scale, ref_inputs=f32, sliding_window=64)


# ----------------------------------------------------------------------------- block skipping
def _visible_blocks(n_q, n_k, bq, bk, S, T, causal, window):
  """Brute force: set of (q block, kv block) pairs with at least one unmasked (i, j)."""
  i, j = np.arange(S)[:, None], np.arange(T)[None, :]
  mask = np.ones((S, T), bool)
  if causal:
    mask &= j <= i
  if window is not None:
    mask &= j > i - window
  return {(a, b) for a in range(n_q) for b in range(n_k)
          if mask[a * bq:(a + 1) * bq, b * bk:(b + 1) * bk].any()}


@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, 1), (True, 40),
                                           (False, 40), (True, 200)])
@pytest.mark.parametrize("bq,bk", [(32, 32), (32, 64), (64, 16)])
def test_block_ranges_are_tight(causal, window, bq, bk):
  S = T = 192
  n_q, n_k = S // bq, T // bk
  visible = _visible_blocks(n_q, n_k, bq, bk, S, T, causal, window)
  by_kv = {(a, b) for b in range(n_k) for a in range(*q_block_range(
      b, block_q=bq, block_kv=bk, num_q_blocks=n_q, causal=causal, window=window))}
  by_q = {(a, b) for a in range(n_q) for b in range(*kv_block_range(
      a, block_q=bq, block_kv=bk, num_kv_blocks=n_k, causal=causal, window=window))}
  assert by_q == visible
  assert by_kv == visible
  # traced bounds (as in the kernels) agree with the python ones
  lo, hi = kv_block_range(jnp.int32(3), block_q=bq, block_kv=bk, num_kv_blocks=n_k,
                          causal=causal, window=window)
  assert (int(lo), int(hi)) == kv_block_range(3, block_q=bq, block_kv=bk, num_kv_blocks=n_k,
                                              causal=causal, window=window)


def test_kernel_skips_kv_blocks():
  """Counts the kv-block iterations the forward kernel actually runs per query block."""
  q, k, v, _ = _inputs(1, 128, 128, 2, 1, 32)
  _, c = _compiled(lambda q, k, v: flash_attention_debug_counts(
      q, k, v, None, scale=32 ** -0.5, causal=True, sliding_window=32, block_q=32,
      block_kv=32), q, k, v)
  c = np.asarray(c)
  assert np.all(c == c[:, :, ::32].repeat(32, axis=-1))   # one count per query block
  # without skipping every query block would run all 4 kv blocks; causal bounds the top,
  # the window (32) the bottom
  assert c[0, 0, ::32].tolist() == [1, 2, 2, 2]


def test_residuals_are_named_for_remat(capsys):
  """A remat policy keeping "flash_out"/"flash_lse" saves exactly those (no forward recompute)."""
  q, k, v, _ = _inputs(1, 32, 32, 2, 2, 32)
  loss = lambda q, k, v: flash_attention(q, k, v, None, scale=0.2, block_q=32, block_kv=32).sum()
  saved = {}
  for key, policy in (("names", jax.checkpoint_policies.save_only_these_names("flash_out",
                                                                              "flash_lse")),
                      ("nothing", jax.checkpoint_policies.nothing_saveable)):
    print_saved_residuals(jax.checkpoint(loss, policy=policy), q, k, v)
    saved[key] = capsys.readouterr().out
  assert "named 'flash_out'" in saved["names"] and "named 'flash_lse'" in saved["names"]
  assert "f32[1,2,32] named 'flash_lse'" in saved["names"]       # lse: [B, H, S] fp32
  assert "flash_out" not in saved["nothing"] and "flash_lse" not in saved["nothing"]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_to_triton_for_gpu(dtype):
  """Cross-lowering for CUDA on the CPU machine: every kernel takes the Triton path (not Mosaic
  GPU) with all options on; ragged S and a head dim (96) that is padded to a power of two."""
  B, S, H, K, E = 1, 200, 4, 2, 96
  q, k, v = (jax.ShapeDtypeStruct(shape, dtype)           # shapes only: traced and lowered
             for shape in ((B, S, H, E), (B, S, K, E), (B, S, K, E)))
  seg = np.ones((B, S), np.int32)

  def run(q, k, v):
    o, vjp = jax.vjp(lambda q, k, v: flash_attention(
        q, k, v, seg, scale=0.1, sliding_window=64, block_q=64, block_kv=32,
        interpret=False), q, k, v)
    return o, vjp(o)

  try:
    text = jax.jit(run).trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
  except ImportError as e:   # a jaxlib without the GPU lowering pieces
    pytest.skip(f"no CUDA lowering available: {e}")
  assert text.count("__gpu$xla.gpu.triton") == 3     # forward, dq, dk/dv


@pytest.mark.parametrize("E,cap", [(64, 128), (128, 128), (256, 64)])
def test_triton_blocks_are_clipped_to_fit_shared_memory(E, cap):
  """On a GPU (not interpret) the configured 512-row blocks become what fits one program's shared
  memory; the CPU interpreter keeps them (clipped only to the sequence length)."""
  q = jax.ShapeDtypeStruct((1, 1024, 2, E), jnp.float32)    # shapes only: traced, not run
  k = v = jax.ShapeDtypeStruct((1, 1024, 1, E), jnp.float32)

  def blocks(interpret):
    config = []
    jax.make_jaxpr(lambda q, k, v: config.append(_prepare(
        q, k, v, None, scale=1.0, causal=True, sliding_window=None, block_q=512, block_kv=512,
        interpret=interpret)[-1]))(q, k, v)
    return config[0].block_q, config[0].block_kv
  assert triton_max_block(E) == cap
  assert blocks(False) == (cap, cap)
  assert blocks(True) == (512, 512)
