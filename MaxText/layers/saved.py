"""Naming a value for the remat policies (`jax.ad_checkpoint.checkpoint_name`), on the XLA:CPU-tuned
hot path (`MaxText/backend/hot_path.py`) stored in a form XLA:CPU keeps in 16 bits; on the plain
path (GPU, TPU) the value is named as it is.

A value a policy keeps inside the scanned layer stack is written into a stacked buffer [L, ...]
in the forward loop (dynamic-update-slice) and read back per layer in the backward loop
(dynamic-slice). XLA:CPU has no bf16 dynamic-slice / dynamic-update-slice: its float
normalisation upcasts both, so the whole stacked buffer is converted to fp32 before the backward
loop, one more pass over the buffer every step. `saved(x, name)` names the raw 16 bits
(`uint16`, which every op takes natively) instead and reinterprets them as x's dtype right after:
the value, its gradient and what the policy keeps are unchanged; only the stacked buffer's element
type differs. Values of other widths are named as they are. (A custom JVP, the identity for
tangents, carries the gradient past the integer bits; under a custom VJP the bits inside would
not be visible to the policy.)
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from MaxText.backend import hot_path

# the names the layers give their values for the named remat policies (`layers/stack.py`), as plain
# `checkpoint_name`s (an identity, gone at lowering): the q/k/v projections, the attention
# output projection, the MLP's gate/up and down outputs; the attention op's residuals are named by
# the op (the flash kernels' output + log-sum-exp, splash's, the dot-product core's)
QKV_PROJ, OUT_PROJ, MLP_IN, MLP_DOWN = "qkv_proj", "out_proj", "mlp_in", "mlp_down"
ATTENTION = ("flash_out", "flash_lse", "splash_residuals", "attention_residuals")


def _is_16bit_float(x: jax.Array) -> bool:
  return jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize == 2


def saved_residual(x: jax.Array, name: str) -> jax.Array:
  """x named `name` (16-bit floats: their bits), for a residual inside a custom VJP's forward rule
  (not differentiated there)."""
  if not _is_16bit_float(x) or not hot_path.tuned():
    return checkpoint_name(x, name)
  bits = checkpoint_name(jax.lax.bitcast_convert_type(x, jnp.uint16), name)
  return jax.lax.bitcast_convert_type(bits, x.dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _saved_bits(x: jax.Array, name: str) -> jax.Array:
  return saved_residual(x, name)


@_saved_bits.defjvp
def _saved_bits_jvp(name, primals, tangents):
  return saved_residual(primals[0], name), tangents[0]   # the identity: its tangent passes


def saved(x: jax.Array, name: str) -> jax.Array:
  """x named `name` for the remat policies (16-bit floats: their bits, see the module doc)."""
  if _is_16bit_float(x) and hot_path.tuned():
    return _saved_bits(x, name)
  return checkpoint_name(x, name)
