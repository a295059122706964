"""The gated MLP's activations in a 16-bit compute dtype round once, as torch's bf16 kernels do
(the oracle): silu bit for bit, gelu_tanh within torch's and XLA's fp32 tanh differences."""
import jax
import jax.numpy as jnp
import numpy as np
import torch

from MaxText.layers.mlp import ACTIVATIONS

TORCH = {"silu": torch.nn.functional.silu,
         "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh")}


def _values_and_grads(name):
  rng = np.random.default_rng(0)
  x = (3 * rng.standard_normal((64, 256))).astype(np.float32)
  g = rng.standard_normal((64, 256)).astype(np.float32)
  tx = torch.tensor(x).to(torch.bfloat16).requires_grad_(True)
  ty = TORCH[name](tx)
  (tdx,) = torch.autograd.grad(ty, tx, torch.tensor(g).to(torch.bfloat16))
  y, vjp = jax.vjp(ACTIVATIONS[name], jnp.asarray(x, jnp.bfloat16))
  (dx,) = vjp(jnp.asarray(g, jnp.bfloat16))
  assert y.dtype == dx.dtype == jnp.bfloat16
  as_np = lambda a: np.asarray(jnp.asarray(a, jnp.float32))
  return as_np(y), ty.detach().float().numpy(), as_np(dx), tdx.float().numpy()


def test_silu_is_torchs_bf16_silu():
  y, want, dx, dwant = _values_and_grads("silu")
  np.testing.assert_array_equal(y, want)   # (bf16 ops rounded one by one: ~40 % of values differ)
  assert np.mean(dx != dwant) <= 1e-3      # exp's last fp32 bit may differ between libraries
  np.testing.assert_allclose(dx, dwant, rtol=2 ** -7, atol=2 ** -14)


def test_gelu_tanh_rounds_once():
  y, want, dx, dwant = _values_and_grads("gelu_tanh")
  assert np.mean(y != want) <= 0.1 and np.mean(dx != dwant) <= 0.1   # one-by-one: ~40 %
  np.testing.assert_allclose(y, want, rtol=2 ** -7, atol=2 ** -9)
  np.testing.assert_allclose(dx, dwant, rtol=2 ** -7, atol=2 ** -9)


def test_fp32_is_the_plain_activation():
  x = jnp.asarray(np.random.default_rng(1).standard_normal(100), jnp.float32)
  np.testing.assert_array_equal(ACTIVATIONS["silu"](x), jax.nn.silu(x))
  np.testing.assert_array_equal(ACTIVATIONS["gelu_tanh"](x), jax.nn.gelu(x, approximate=True))
