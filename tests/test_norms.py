"""RMSNorm's hand-written VJP (`layers/norms.py: scaled_rms_norm`) against autodiff of the plain
formula, in both cast orders: fp32 to rounding, bf16 the same input gradient and a scale gradient
that is the fp32 sum of the same bf16 products (autodiff rounds it to bf16 first)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.layers.norms import rms_normalize, scaled_rms_norm

EPS = 1e-6


def plain(x, scale32, dtype, cast_before_scale):
  y = rms_normalize(x, EPS)
  if cast_before_scale:
    return y.astype(dtype) * scale32.astype(dtype)
  return (y * scale32).astype(dtype)


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.max(np.abs(a - b)) / np.max(np.abs(b))


@functools.partial(jax.jit, static_argnums=0)
def draw(dtype):
  """x, the fp32 scale and a cotangent in one program (eagerly each draw compiles alone)."""
  kx, ks, kg = jax.random.split(jax.random.key(0), 3)
  x = (3 * jax.random.normal(kx, (2, 16, 3, 64), jnp.float32)).astype(dtype)
  scale = 1 + jax.random.normal(ks, (64,), jnp.float32)
  g = jax.random.normal(kg, x.shape, jnp.float32).astype(dtype)
  return x, scale, g


@pytest.mark.parametrize("cast_before_scale", [True, False])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_vjp_matches_autodiff(dtype, cast_before_scale):
  x, scale, g = draw(dtype)
  # each side's output and gradients one program (eagerly every op compiles alone)
  with_vjp = lambda f: jax.jit(lambda x, s, g: (lambda y, vjp: (y, *vjp(g)))(*jax.vjp(f, x, s)))
  y, dx, ds = with_vjp(lambda x, s: scaled_rms_norm(x, s, EPS, jnp.dtype(dtype),
                                                    cast_before_scale))(x, scale, g)
  y_ref, dx_ref, ds_ref = with_vjp(lambda x, s: plain(x, s, dtype, cast_before_scale))(x, scale, g)
  assert (y.dtype, dx.dtype, ds.dtype) == (dtype, dtype, jnp.float32)
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_ref, np.float32))
  # the input gradient: the same products; fp32 differs by the summation order of the row mean
  assert rel(np.asarray(dx, np.float32), np.asarray(dx_ref, np.float32)) <= (1e-6 if dtype == jnp.float32 else 2**-8)
  if dtype == jnp.float32 or not cast_before_scale:
    assert rel(ds, ds_ref) <= 1e-5
  else:   # the fp32 sum over the tokens of the bf16 products g · x̂ (autodiff sums them in bf16:
          # here 1.4 % of the largest entry away from this sum)
    # (the products rounded to bf16 in NumPy: a jit may fuse the cast away and keep them fp32)
    x_hat = np.asarray(jax.jit(lambda x: rms_normalize(x, EPS).astype(dtype))(x))
    want = (np.asarray(g) * x_hat).astype(np.float32).sum((0, 1, 2))
    assert rel(ds, want) <= 1e-5
