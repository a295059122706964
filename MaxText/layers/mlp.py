"""Gated MLP: down(act(gate(x)) * up(x)) — SwiGLU with silu, GeGLU with tanh-approximated gelu."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from MaxText.layers.activations import gelu_tanh
from MaxText.layers.linear import DenseGeneral, LayerKw, fused_dense
from MaxText.layers.saved import MLP_DOWN, MLP_IN
from MaxText.sharding.rules import constrain


def _rounded_once(fn):
  """fn computed in fp32 and rounded once to x's dtype, as torch's bf16 kernels compute an
  activation (the same function in fp32). Written on bf16 operands, XLA:CPU rounds after each of
  the activation's ops (silu: negate, exp, add, divide, multiply) and repeats them in the
  backward pass, so the gated MLP's activation fusions do several rounding passes where one
  suffices, forward and backward."""
  def act(x):
    return fn(x.astype(jnp.float32)).astype(x.dtype)
  return act


ACTIVATIONS = {"silu": _rounded_once(jax.nn.silu),
               "gelu_tanh": _rounded_once(gelu_tanh)}
ACT_BSD = ("activation_batch", "activation_length", "activation_embed")
ACT_BSF = ("activation_batch", "activation_length", "activation_mlp")


class GatedMLP(nnx.Module):
  def __init__(self, emb_dim: int, mlp_dim: int, activation: str, *, rngs: nnx.Rngs,
               dtype: jnp.dtype, param_dtype: jnp.dtype):
    kw = LayerKw(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    self.gate = DenseGeneral((emb_dim,), (mlp_dim,), ("embed", "mlp"), **kw)
    self.up = DenseGeneral((emb_dim,), (mlp_dim,), ("embed", "mlp"), **kw)
    self.down = DenseGeneral((mlp_dim,), (emb_dim,), ("mlp", "embed"), **kw)
    self.act = ACTIVATIONS[activation]

  def __call__(self, x_BSD):
    gate_BSF, up_BSF = (checkpoint_name(y, MLP_IN) for y in fused_dense((self.gate, self.up), x_BSD))
    h_BSF = constrain(self.act(gate_BSF) * up_BSF, ACT_BSF)
    return constrain(checkpoint_name(self.down(h_BSF), MLP_DOWN), ACT_BSD)
