"""tanh and the tanh-approximated GELU with a derivative that does not cancel.

autodiff's tanh derivative is (1 - t)(1 + t) of the computed t = tanh(x): where |t| -> 1 that
difference cancels, and a tanh accurate to eps relative gives a derivative off by ~eps / (1 - |t|).
In float32 on a CPU, against float64 where the derivative is above 1e-3: tanh' off by up to 3.7e-4,
GELU(tanh)' by 1.3e-3; with the derivative below, 2.5e-7 and 8.4e-5 (benchmarks/tpu_diag_precision.py,
tests/test_activations.py). A TPU's float32 tanh differs from the CPU's by up to ~8e-5 relative
(measured on a v5e), which that cancellation turns into per-element gradient differences between the
two — Gemma 4's first gradients (GeGLU MLPs, per-layer input gates) differed by 1e-3..8e-3 per
array at `highest` precision (benchmarks/tpu_diag_grads.py; whether this closes it is to be
measured there). Here sech^2(x) is 1 - t^2 only where |x| < 1/2 (t^2 < 0.22: nothing cancels),
else 4e / (1 + e)^2 with e = exp(-2|x|), as accurate as exp. The values are jnp.tanh's and
jax.nn.gelu(approximate=True)'s, bit for bit (the same operations).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

SMALL = 0.5     # |x| below which 1 - tanh(x)^2 is used as it is


@jax.custom_jvp
def tanh(x: jax.Array) -> jax.Array:
  return jnp.tanh(x)


@tanh.defjvp
def _tanh_jvp(primals, tangents):
  (x,), (dx,) = primals, tangents
  t = jnp.tanh(x)
  ax = jnp.abs(x)
  e = jnp.exp(-2 * ax)
  sech2 = jnp.where(ax < SMALL, 1 - t * t, 4 * e / ((1 + e) * (1 + e)))
  return t, dx * sech2


def gelu_tanh(x: jax.Array) -> jax.Array:
  """jax.nn.gelu(x, approximate=True) (transformers' gelu_pytorch_tanh) with `tanh` above."""
  c = np.sqrt(2 / np.pi).astype(x.dtype)
  return x * (0.5 * (1.0 + tanh(c * (x + 0.044715 * (x ** 3)))))

