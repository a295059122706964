"""`layers/saved.py`: a bf16 value named for the remat policies is kept as its 16 raw bits (XLA:CPU
slices those natively), with the same value and gradient as a plain `checkpoint_name`; the bf16
dot-product attention core's residuals are kept by `save_matmuls`, none by `full`."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name, print_saved_residuals

from MaxText.layers.attention_lowp import attention_core
from MaxText.layers.saved import saved
from MaxText.layers.stack import REMAT_POLICIES

POLICY = jax.checkpoint_policies.save_only_these_names("n")


def _loss(name_fn):
  def f(x, w):
    y = name_fn(jnp.sin(x @ w), "n")
    return jnp.sum(jnp.cos(y).astype(jnp.float32) * jnp.arange(y.size).reshape(y.shape))
  return f


def test_bf16_value_is_saved_as_bits_with_the_same_gradient(capsys):
  x = jax.random.normal(jax.random.key(0), (4, 8), jnp.bfloat16)
  w = jax.random.normal(jax.random.key(1), (8, 6), jnp.bfloat16)
  print_saved_residuals(jax.checkpoint(_loss(saved), policy=POLICY), x, w)
  out = capsys.readouterr().out
  assert "u16[4,6] named 'n'" in out, out
  got = jax.grad(jax.checkpoint(_loss(saved), policy=POLICY), argnums=(0, 1))(x, w)
  want = jax.grad(jax.checkpoint(_loss(checkpoint_name), policy=POLICY), argnums=(0, 1))(x, w)
  for g, h in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(h, np.float32))


def test_fp32_value_is_named_as_it_is(capsys):
  x = jnp.ones((4, 8), jnp.float32)
  w = jnp.ones((8, 6), jnp.float32)
  print_saved_residuals(jax.checkpoint(_loss(saved), policy=POLICY), x, w)
  assert "f32[4,6] named 'n'" in capsys.readouterr().out


def test_attention_residuals_are_kept_by_save_matmuls(capsys):
  B, K, Q, E = 1, 2, 16, 8
  ks = jax.random.split(jax.random.key(2), 3)
  q, k, v = (jax.random.normal(kk, (B, K, Q, E), jnp.bfloat16) for kk in ks)
  mask = jnp.tril(jnp.ones((Q, Q), bool))[None, None]
  loss = lambda q, k, v: attention_core(jnp.sin(q), k, v, mask, 0.3).astype(jnp.float32).sum()
  saved_lines = {}
  for policy in ("save_matmuls", "full"):
    print_saved_residuals(jax.checkpoint(loss, policy=REMAT_POLICIES[policy]), q, k, v)
    saved_lines[policy] = [line.split()[0] for line in capsys.readouterr().out.splitlines()
                           if "attention_residuals" in line]
  # q (after the sin), k, v, the output as raw bf16 bits; the log-sum-exp in fp32
  assert sorted(saved_lines["save_matmuls"]) == sorted(["u16[1,2,16,8]"] * 4 + ["f32[1,2,16]"])
  assert saved_lines["full"] == []
