"""The weight matmul (`layers/linear.py: matmul`): bf16 forward/backward against an fp32 reference
computed from the same bf16-rounded operands, the dot forms XLA:CPU runs in bf16, and a
batch-sharded weight gradient that stays local (no activation all-gather). `fused_dense`: the
projections of one input as one matmul, equal to the layers called one by one."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from flax import nnx

from MaxText.backend import hot_path
from MaxText.layers import linear
from MaxText.layers.linear import DenseGeneral, fused_dense, matmul, row_major_transpose
from MaxText.sharding.rules import parse_rules, use_rules

M, K, N = 64, 32, 48


@jax.jit
def operands(seed=0):
  """One program (eagerly each random draw and cast compiles alone)."""
  kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(kx, (M, K), jnp.float32).astype(jnp.bfloat16)
  w = jax.random.normal(kw, (K, N), jnp.float32) * K ** -0.5          # fp32 master weight
  dy = jax.random.normal(kd, (M, N), jnp.float32).astype(jnp.bfloat16)
  return x, w, dy


def amax(x) -> float:
  """max |x| in fp32, on the host (a jnp reduction outside a jit compiles a program per shape)."""
  return float(np.abs(np.asarray(x, np.float32)).max())


def test_row_major_transpose_is_the_transpose():
  x, _, _ = operands()
  np.testing.assert_array_equal(np.asarray(jax.jit(row_major_transpose)(x)), np.asarray(x).T)


@pytest.mark.parametrize("w_is_NK", [False, True])          # x @ w, and x @ w.T (tied head)
@pytest.mark.parametrize("out_dtype", [None, jnp.float32])  # bf16 result, or fp32 logits
@pytest.mark.parametrize("path", ["tuned", "plain"])        # MaxText/backend/hot_path.py
def test_bf16_matmul_and_grads_match_fp32_reference(w_is_NK, out_dtype, path):
  x, w, dy = operands()
  if w_is_NK:
    w = w.T
  f = lambda x, w: matmul(x, w, w_is_NK=w_is_NK, out_dtype=out_dtype)

  def forward_backward(x, w, dy):   # one program (eagerly each op compiles alone)
    y, vjp = jax.vjp(f, x, w)
    return (y, *vjp(dy.astype(y.dtype)))

  with hot_path.use(path):          # traced here: a new function, so no trace of the other path
    y, dx, dw = jax.jit(forward_backward)(x, w, dy)
  assert (y.dtype, dx.dtype, dw.dtype) == (out_dtype or jnp.bfloat16, jnp.bfloat16, jnp.float32)
  # the fp32 reference in NumPy (float32 products of the bf16 values are exact; fp32 sums)
  x32, dy32 = np.asarray(x, np.float32), np.asarray(dy, np.float32)
  w16 = np.asarray(w).astype(jnp.bfloat16).astype(np.float32)        # what the dot sees
  w16_KN = w16.T if w_is_NK else w16
  y_ref = x32 @ w16_KN
  dx_ref = dy32 @ w16_KN.T
  dw_ref = x32.T @ dy32
  if w_is_NK:
    dw_ref = dw_ref.T
  # bf16 results: fp32 accumulation rounded once to bf16 (half an ulp: 2^-8 relative)
  for got, ref in ((y, y_ref), (dx, dx_ref)):
    tol = 1e-5 if got.dtype == jnp.float32 else 2**-8
    np.testing.assert_allclose(np.asarray(got, np.float32), ref, rtol=tol, atol=tol * amax(ref))
  # tuned: dw stays fp32, only the summation order differs (K-term sums of bf16 products); plain:
  # autodiff's dot of bf16 operands has a bf16 result (the forward's cast of w transposed after
  # it), the fp32 accumulator rounded once (2^-8 relative, as above)
  tol = 1e-5 if path == "tuned" else 2**-8
  np.testing.assert_allclose(np.asarray(dw), dw_ref, rtol=tol, atol=tol * amax(dw_ref))


def test_fp32_matmul_is_the_plain_product():
  x, w, dy = operands()
  x = x.astype(jnp.float32)
  y, vjp = jax.vjp(matmul, x, w)
  y_ref, vjp_ref = jax.vjp(lambda a, b: a @ b, x, w)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))
  for got, ref in zip(vjp(dy.astype(jnp.float32)), vjp_ref(dy.astype(jnp.float32))):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))


def _dot_operand_types(hlo: str) -> list[tuple[str, str]]:
  """(lhs type, rhs type) of every dot in the fused computations of compiled CPU HLO."""
  out = []
  for block in re.split(r"\n(?=%)", hlo):
    m = re.search(r"dot\(%([\w.\-]+), %([\w.\-]+)\)", block)
    if m:
      ty = lambda n, block=block: re.search(r"%" + re.escape(n) + r" = (\w+)\[", block).group(1)
      out.append((ty(m.group(1)), ty(m.group(2))))
  return out


def test_bf16_dots_are_not_upcast_on_cpu():
  """All three dots (forward, input gradient, weight gradient) keep bf16 operands."""
  if jax.devices()[0].platform != "cpu":
    return
  x, w, dy = operands()
  f = lambda x, w, dy: jax.vjp(matmul, x, w)[1](dy)
  with hot_path.use("tuned"):   # (what a numeric check cannot see: XLA:CPU's operand upcast)
    hlo = jax.jit(lambda x, w, dy: (matmul(x, w), *f(x, w, dy))).lower(x, w, dy).compile().as_text()
  types = _dot_operand_types(hlo)
  assert len(types) == 3 and all(t == ("bf16", "bf16") for t in types), types


def test_batch_sharded_weight_gradient_gathers_no_activations():
  """x and dy split over the batch: the weight gradient is a local dot plus a reduction; the
  [tokens, features] operands are never all-gathered (a flattening transpose would force that)."""
  devices = jax.devices()[:2]
  mesh = Mesh(np.asarray(devices), ("fsdp",), axis_types=(AxisType.Auto,))
  x, w, dy = operands()
  rows = NamedSharding(mesh, P("fsdp", None))
  x, dy = jax.device_put(x, rows), jax.device_put(dy, rows)
  w = jax.device_put(w, NamedSharding(mesh, P("fsdp", None)))
  grad_w = jax.jit(lambda x, w, dy: jax.vjp(matmul, x, w)[1](dy)[1],
                   out_shardings=NamedSharding(mesh, P("fsdp", None)))
  hlo = grad_w.lower(x, w, dy).compile().as_text()
  gathered = re.findall(r"= (\w+\[[\d,]*\])\{[\d,]*\} all-gather\(", hlo)
  assert all(not s.endswith((f"[{M},{K}]", f"[{M},{N}]", f"[{K},{M}]")) for s in gathered), gathered
  ref = jnp.dot(x.astype(jnp.float32).T, dy.astype(jnp.float32), precision="highest")
  np.testing.assert_allclose(np.asarray(grad_w(x, w, dy)), np.asarray(ref), rtol=1e-5, atol=1e-5)


def _projections(dtype):
  """q [D → H, E], k [D → K, E] and a gate-like [D → F] kernel (fp32 master weights)."""
  def build():    # in one program: eagerly each initializer's ops compile alone
    kw = dict(rngs=nnx.Rngs(3), dtype=dtype, param_dtype=jnp.float32)
    return (DenseGeneral((K,), (4, 8), ("embed", "heads", "head_dim"), **kw),
            DenseGeneral((K,), (2, 8), ("embed", "kv_heads", "head_dim"), **kw),
            DenseGeneral((K,), (N,), ("embed", "mlp"), **kw))
  return nnx.jit(build)()


def weight_matmuls(monkeypatch) -> list:
  """Counts the weight matmuls (`linear.matmul` calls) traced from here on."""
  calls, real = [], linear.matmul
  monkeypatch.setattr(linear, "matmul", lambda *a, **k: calls.append(1) or real(*a, **k))
  return calls


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_fused_projections_equal_the_layers_one_by_one(dtype, monkeypatch):
  layers = _projections(dtype)
  x = jax.random.normal(jax.random.key(5), (2, M // 2, K), jnp.float32).astype(dtype)
  graphdef, params = nnx.split(layers)

  def loss(params, x, fuse):
    ls = nnx.merge(graphdef, params)
    ys = fused_dense(ls, x) if fuse else [l(x) for l in ls]
    return sum(jnp.sum(y.astype(jnp.float32) * (i + 1)) for i, y in enumerate(ys)), ys

  # each side one program (eagerly every op of the layers and their gradients compiles alone)
  grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True), static_argnums=2)
  (_, got), g_got = grads(params, x, True)
  (_, want), g_want = grads(params, x, False)
  assert [y.shape for y in got] == [(2, M // 2, 4, 8), (2, M // 2, 2, 8), (2, M // 2, N)]
  # each output column is the same K-term dot, fp32 accumulated, rounded once to the dtype
  for a, b in zip(got, want):
    assert a.dtype == dtype
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2**-8,
                               atol=2**-8 * amax(b))
  for a, b in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want)):
    assert a.dtype == b.dtype
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2**-7,
                               atol=2**-7 * amax(b))
  calls = weight_matmuls(monkeypatch)
  jax.eval_shape(lambda p, x: loss(p, x, True), params, x)
  # bf16: one weight matmul for the three; fp32: the three dots as before
  assert len(calls) == (1 if dtype == jnp.bfloat16 else 3), calls


def test_fused_projections_stay_separate_when_the_mesh_splits_an_output_axis(monkeypatch):
  layers = _projections(jnp.bfloat16)
  x = jax.random.normal(jax.random.key(5), (2, M // 2, K), jnp.float32).astype(jnp.bfloat16)
  mesh = Mesh(np.asarray(jax.devices()[:2]), ("tensor",), axis_types=(AxisType.Auto,))
  rules = parse_rules([["heads", "tensor"], ["kv_heads", "tensor"], ["mlp", "tensor"]], ["tensor"])
  calls = weight_matmuls(monkeypatch)
  with use_rules(mesh, rules):
    jax.eval_shape(lambda x: fused_dense(layers, x), x)
  assert len(calls) == 3, calls


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_dense_takes_a_slice_of_its_output_axis(dtype):
  """An LM head given a vocabulary slice of its kernel (the chunked loss's head split) returns
  those columns of the whole head's output."""
  head = nnx.jit(lambda: DenseGeneral((K,), (N,), ("embed", "vocab"), rngs=nnx.Rngs(2),
                                      dtype=dtype, param_dtype=jnp.float32))()
  x = np.random.default_rng(4).normal(size=(2, 8, K)).astype(np.float32)
  apply = nnx.jit(lambda head, x: head(x, out_dtype=jnp.float32))   # eagerly: a program an op
  whole = apply(head, x)
  head.kernel.set_value(np.asarray(head.kernel[...])[:, N // 4: N // 2])
  part = apply(head, x)
  assert part.shape == (2, 8, N // 4)
  # the same K-term fp32 dot per column; a narrower matmul may block the sum differently
  want = np.asarray(whole[..., N // 4: N // 2])
  np.testing.assert_allclose(np.asarray(part), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
