"""The layer scan's `unroll` switch (`stack.SCAN_UNROLL`, for A/Bs): the same function and gradients
whatever the number of layers per loop iteration."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from MaxText.layers import stack


class Layer(nnx.Module):
  def __init__(self, kind, rngs: nnx.Rngs):
    self.w = nnx.Param(jax.random.normal(rngs.params(), (8, 8)) / 3)
    self.kind = kind

  def __call__(self, x, scale):
    return x + jnp.tanh(x @ self.w[...]) * scale


def _loss_and_grads(unroll, monkeypatch):
  monkeypatch.setattr(stack, "SCAN_UNROLL", unroll)
  model = stack.PatternStack(Layer, ["a"] * 4, scan=True, remat_policy="full", rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (3, 8))
  graphdef, params = nnx.split(model)

  def loss(p):
    return jnp.sum(nnx.merge(graphdef, p)(x, 0.5) ** 2)

  step = jax.jit(jax.value_and_grad(loss))
  loops = step.lower(params).as_text().count("stablehlo.while")
  return step(params), loops


def test_unrolled_layer_scan_matches_the_loop(monkeypatch):
  ((l1, g1), loops1), ((l4, g4), loops4) = (_loss_and_grads(u, monkeypatch) for u in (1, 4))
  assert loops1 == 2 and loops4 == 0   # forward and backward scan; none when fully unrolled
  np.testing.assert_allclose(l4, l1, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g4), jax.tree.leaves(g1)):
    assert a.shape == (4, 8, 8)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
