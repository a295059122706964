"""layers/activations.py: tanh and GELU(tanh) whose derivative does not cancel where |tanh| -> 1.
Their values are jax's bit for bit; their derivatives are float32-accurate against float64 where
autodiff's (1 - t)(1 + t) of the computed tanh is not (the same measurement as
benchmarks/tpu_diag_precision.py's derivative rows)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.layers import activations

X = np.linspace(-12, 12, 1 << 16).astype(np.float32)
X64 = X.astype(np.float64)
C = np.sqrt(2 / np.pi)
U = C * (X64 + 0.044715 * X64 ** 3)
TANH_D = 1 / np.cosh(X64) ** 2
GELU_D = 0.5 * (1 + np.tanh(U)) + 0.5 * X64 / np.cosh(U) ** 2 * C * (1 + 3 * 0.044715 * X64 ** 2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_values_are_jaxs_bit_for_bit(dtype):
  x = jnp.asarray(X, dtype)
  np.testing.assert_array_equal(jax.jit(activations.tanh)(x), jax.jit(jnp.tanh)(x))
  np.testing.assert_array_equal(jax.jit(activations.gelu_tanh)(x),
                                jax.jit(lambda v: jax.nn.gelu(v, approximate=True))(x))


def _rel_where_significant(fn, want):
  """The largest relative error of fn's derivative where the derivative is above 1e-3."""
  got = np.asarray(jax.jit(jax.vmap(jax.grad(fn)))(jnp.asarray(X)), np.float64)
  big = np.abs(want) > 1e-3
  return float(np.max(np.abs(got - want)[big] / np.abs(want)[big]))


def test_derivatives_are_float32_accurate_where_autodiffs_cancel():
  ours_tanh = _rel_where_significant(activations.tanh, TANH_D)
  ours_gelu = _rel_where_significant(activations.gelu_tanh, GELU_D)
  assert ours_tanh < 1e-6 and ours_gelu < 2e-4, (ours_tanh, ours_gelu)
  # autodiff of the same functions: the cancellation these avoid
  plain_tanh = _rel_where_significant(jnp.tanh, TANH_D)
  plain_gelu = _rel_where_significant(lambda v: jax.nn.gelu(v, approximate=True), GELU_D)
  assert plain_tanh > 30 * ours_tanh and plain_gelu > 5 * ours_gelu, (plain_tanh, plain_gelu)


def test_gradients_agree_with_autodiff_where_nothing_cancels():
  x = jnp.asarray(X[np.abs(X) < 0.5])
  for ours, plain in ((activations.tanh, jnp.tanh),
                      (activations.gelu_tanh, lambda v: jax.nn.gelu(v, approximate=True))):
    np.testing.assert_allclose(jax.vmap(jax.grad(ours))(x), jax.vmap(jax.grad(plain))(x),
                               rtol=2e-6, atol=1e-7)
