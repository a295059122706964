"""The bf16 dot-product attention core (`layers/attention_lowp.py`): output and q/k/v gradients
against an fp32 reference on the same bf16 inputs (packed documents, causal, GQA), and every dot
of forward + backward keeps bf16 operands on XLA:CPU. Causal query blocks (`attention_ops`) equal
the whole S x S attention, with packing and sliding windows, in fp32 and bf16; the tuned core
runs sequences shorter than MIN_BLOCKED_LENGTH as one block."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.backend import hot_path
from MaxText.layers import attention_ops
from MaxText.layers.attention_ops import dot_product_attention
from test_linear import _dot_operand_types

B, S, H, K, E = 2, 64, 4, 2, 32


@jax.jit
def _draw():
  """q, k, v, do in one program (eagerly each draw and cast compiles alone)."""
  kq, kk, kv, kd = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(kq, (B, S, H, E)).astype(jnp.bfloat16)
  k = jax.random.normal(kk, (B, S, K, E)).astype(jnp.bfloat16)
  v = jax.random.normal(kv, (B, S, K, E)).astype(jnp.bfloat16)
  do = jax.random.normal(kd, (B, S, H, E)).astype(jnp.bfloat16)
  return q, k, v, do


def inputs():
  seg = np.ones((B, S), np.int32)
  seg[1, 40:] = 2
  seg[0, 50:] = 0
  return (*_draw(), seg)


@pytest.mark.parametrize("path", ["tuned", "plain"])   # the bf16 core, or autodiff's (hot_path.py)
def test_bf16_attention_and_grads_match_fp32_reference(path):
  q, k, v, do, seg = inputs()
  f = lambda q, k, v: dot_product_attention(q, k, v, seg, scale=E ** -0.5)
  # output and gradients in one program each (eagerly every op compiles alone); a new function
  # traced under each path, so neither reuses the other's trace
  run = lambda q, k, v, do: (lambda o, vjp: (o, *vjp(do)))(*jax.vjp(f, q, k, v))
  with hot_path.use(path):
    o, *grads = jax.jit(run)(q, k, v, do)
  up = lambda x: np.asarray(x, np.float32)                    # exact: bf16 -> fp32
  o_ref, *grads_ref = (np.asarray(x) for x in jax.jit(lambda q, k, v, do: run(q, k, v, do))(
      up(q), up(k), up(v), up(do)))                           # the fp32 XLA path, same inputs
  assert o.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
  # bf16 rounding of the probabilities and of the results: ~2^-8 relative, a few ulps summed
  for got, ref in ((o, o_ref), *zip(grads, grads_ref)):
    err = float(np.max(np.abs(up(got) - ref)) / np.max(np.abs(ref)))
    assert err < 2e-2, err


def test_bf16_attention_dots_are_not_upcast_on_cpu():
  if jax.devices()[0].platform != "cpu":
    return
  q, k, v, do, seg = inputs()
  f = lambda q, k, v: dot_product_attention(q, k, v, seg, scale=E ** -0.5)
  step = lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do)
  with hot_path.use("tuned"):   # (what a numeric check cannot see: XLA:CPU's operand upcast)
    hlo = jax.jit(step).lower(q, k, v, do).compile().as_text()
  types = _dot_operand_types(hlo)
  assert len(types) >= 5 and all(t == ("bf16", "bf16") for t in types), types


def test_causal_query_blocks_skip_only_masked_keys():
  # 4 blocks of 16 queries (G = 2 folded rows each): keys up to each block's end; with a window
  # of 8 from the block's first query minus 7
  assert attention_ops.causal_query_blocks(64, 64, 2, None) is None          # QUERY_BLOCK 64
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(attention_ops, "QUERY_BLOCK", 16)
    assert attention_ops.causal_query_blocks(64, 64, 2, None) == (
        (0, 32, 0, 16), (32, 64, 0, 32), (64, 96, 0, 48), (96, 128, 0, 64))
    assert attention_ops.causal_query_blocks(64, 64, 2, 8) == (
        (0, 32, 0, 16), (32, 64, 9, 32), (64, 96, 25, 48), (96, 128, 41, 64))
    assert attention_ops.causal_query_blocks(64, 80, 2, None) is None        # T != S
    mp.setattr(attention_ops, "QUERY_BLOCK", 8)                             # at most 4 blocks
    assert len(attention_ops.causal_query_blocks(64, 64, 1, None)) == 4


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("window", [None, 12])
def test_query_blocks_equal_one_block(dtype, window):
  """Causal query blocks (4 of 16 queries, packed documents and padding) give the output and
  q/k/v gradients of the whole S x S attention: only fully masked keys are skipped, so only the
  summation order differs (fp32: ~1e-6; bf16: the roundings of results of a few ulps apart)."""
  q, k, v, do, seg = (np.asarray(x).astype(dtype) if x.dtype == jnp.bfloat16 else x
                      for x in inputs())   # host casts (exact to fp32): no one-op programs
  f = lambda q, k, v: dot_product_attention(q, k, v, seg, scale=E ** -0.5, sliding_window=window)
  run = jax.jit(lambda q, k, v, do: (lambda o, vjp: (o, *vjp(do)))(*jax.vjp(f, q, k, v)))
  whole = run(q, k, v, do)
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(attention_ops, "QUERY_BLOCK", 16)
    mp.setattr(attention_ops, "MIN_BLOCKED_LENGTH", 0)   # bf16 on CPU: the tuned core blocks too
    blocked = jax.jit(lambda q, k, v, do: (lambda o, vjp: (o, *vjp(do)))(*jax.vjp(f, q, k, v)))(
        q, k, v, do)
  tol = 1e-5 if dtype == jnp.float32 else 2 ** -6
  for got, ref in zip(blocked, whole):
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    assert np.max(np.abs(got - ref)) <= tol * np.max(np.abs(ref)), np.max(np.abs(got - ref))


def test_tuned_core_runs_short_sequences_as_one_block():
  """Below MIN_BLOCKED_LENGTH the tuned bf16 core gets no query blocks (fewer dots, one block's);
  the plain path blocks as before."""
  q, k, v, do, seg = inputs()

  def dots():   # a new function each time: make_jaxpr would reuse a cached trace of the same one
    f = lambda q, k, v: dot_product_attention(q, k, v, seg, scale=E ** -0.5)
    return str(jax.make_jaxpr(lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do))(
        q, k, v, do)).count("dot_general")
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(attention_ops, "QUERY_BLOCK", 16)   # 4 blocks at S = 64
    with hot_path.use("tuned"):
      assert S < attention_ops.MIN_BLOCKED_LENGTH
      short = dots()
      mp.setattr(attention_ops, "MIN_BLOCKED_LENGTH", S)
      blocked = dots()
  assert short > 0 and blocked == 4 * short, (short, blocked)   # the same dots per block
