"""Depthwise causal 1-D convolution over the sequence, aware of packed documents, and its one-token
step with an explicit window (decoding).

Conventions: B batch, S sequence, W kernel width, `...` any channel dims (the same for the input,
the kernel's trailing dims and the output).

  out[t] = Σ_{j<W} w[j] · x[t − (W−1) + j]

over inputs of the same document only: a token never sees the tail of the previous packed
document (the window restarts at every document start, as if the document were run alone with
zero left padding — Hugging Face's `conv1d(padding=W−1)`). Computed in fp32; the caller casts.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_conv(x_BS_, w_W_, reset_BS) -> jax.Array:
  """`x_BS_` [B, S, ...], kernel `w_W_` [W, ...], `reset_BS` True at each document's first token.
  Returns [B, S, ...] fp32: W shifted multiply-adds, each masked to the token's own document."""
  B, S = x_BS_.shape[:2]
  W = w_W_.shape[0]
  x = x_BS_.astype(jnp.float32)
  w = w_W_.astype(jnp.float32)
  doc_BS = jnp.cumsum(reset_BS.astype(jnp.int32), axis=1)
  channels = (1,) * (x.ndim - 2)
  out = x * w[W - 1]
  for shift in range(1, min(W, S)):
    x_shift = jnp.pad(x[:, :S - shift], [(0, 0), (shift, 0)] + [(0, 0)] * len(channels))
    doc_shift = jnp.pad(doc_BS[:, :S - shift], [(0, 0), (shift, 0)], constant_values=-1)
    same = (doc_shift == doc_BS).reshape(B, S, *channels)
    out = out + jnp.where(same, x_shift, 0.0) * w[W - 1 - shift]
  return out


def causal_conv_step(window_BW_, x_B_, w_W_) -> tuple[jax.Array, jax.Array]:
  """One token: `window_BW_` [B, W−1, ...] holds the previous W−1 inputs of the document (oldest
  first; zeros at its start), `x_B_` [B, ...] the new input. Returns (out [B, ...] fp32, the next
  window)."""
  full = jnp.concatenate([window_BW_.astype(jnp.float32), x_B_.astype(jnp.float32)[:, None]], 1)
  out = jnp.einsum("bw...,w...->b...", full, w_W_.astype(jnp.float32))
  return out, full[:, 1:].astype(window_BW_.dtype)
