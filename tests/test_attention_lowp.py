"""The bf16 dot-product attention core (`layers/attention_lowp.py`): output and q/k/v gradients
against an fp32 reference on the same bf16 inputs (packed documents, causal, GQA), and every dot
of forward + backward keeps bf16 operands on XLA:CPU."""
import jax
import jax.numpy as jnp
import numpy as np

from MaxText.layers.attention_ops import dot_product_attention
from test_linear import _dot_operand_types

B, S, H, K, E = 2, 64, 4, 2, 32


def inputs():
  kq, kk, kv, kd = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(kq, (B, S, H, E)).astype(jnp.bfloat16)
  k = jax.random.normal(kk, (B, S, K, E)).astype(jnp.bfloat16)
  v = jax.random.normal(kv, (B, S, K, E)).astype(jnp.bfloat16)
  do = jax.random.normal(kd, (B, S, H, E)).astype(jnp.bfloat16)
  seg = np.ones((B, S), np.int32)
  seg[1, 40:] = 2
  seg[0, 50:] = 0
  return q, k, v, do, jnp.asarray(seg)


def test_bf16_attention_and_grads_match_fp32_reference():
  q, k, v, do, seg = inputs()
  f = lambda q, k, v: dot_product_attention(q, k, v, seg, scale=E ** -0.5)
  o, vjp = jax.vjp(f, q, k, v)
  grads = vjp(do)
  up = lambda x: x.astype(jnp.float32)
  o_ref, vjp_ref = jax.vjp(f, up(q), up(k), up(v))          # the fp32 XLA path, same inputs
  grads_ref = vjp_ref(up(do))
  assert o.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
  # bf16 rounding of the probabilities and of the results: ~2^-8 relative, a few ulps summed
  for got, ref in ((o, o_ref), *zip(grads, grads_ref)):
    err = float(jnp.max(jnp.abs(up(got) - ref)) / jnp.max(jnp.abs(ref)))
    assert err < 2e-2, err


def test_bf16_attention_dots_are_not_upcast_on_cpu():
  if jax.devices()[0].platform != "cpu":
    return
  q, k, v, do, seg = inputs()
  f = lambda q, k, v: dot_product_attention(q, k, v, seg, scale=E ** -0.5)
  step = lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do)
  hlo = jax.jit(step).lower(q, k, v, do).compile().as_text()
  types = _dot_operand_types(hlo)
  assert len(types) >= 5 and all(t == ("bf16", "bf16") for t in types), types
