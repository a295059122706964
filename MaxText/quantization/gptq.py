"""Weight quantization of one matrix: round-to-nearest (RTN) and GPTQ (Frantar et al., 2022), with
act-order. Pure JAX, no model: `w_KN` is a projection's kernel as the model multiplies it
(x_MK @ w_KN), `h_KK` the Hessian of its input (X^T X summed over calibration tokens).

Quantizer: symmetric, per group of `group_size` consecutive input rows (K) and per output column
(N): scale = max|w| / qmax over the group (qmax = 2^(bits-1) - 1; an all-zero group gets scale 1),
q = clip(round(w / scale), -qmax - 1, qmax), ŵ = q * scale. `group_size` 0 (or K) is one group.

GPTQ, column by column over K in processing order (act-order: by descending Hessian diagonal,
else 0..K-1), with H damped by `damp` x mean(diag H) and U the upper Cholesky factor of H^-1
(H^-1 = U^T U):
    q_k = quant(w_k);  err = (w_k - ŵ_k) / U_kk;  w_j -= err * U_kj for every later column j
Blocked lazy updates: inside a block of `block_size` columns the update touches the block only;
the accumulated errors update the columns after the block in one matmul at its end (the same
arithmetic, reordered). A column of H that is zero (an input that never fired) gets H_kk = 1 and
w_k = 0. Group scales: without act-order each group's scale is taken from the group's current
(already updated) weights when its first column is reached (as the GPTQ reference does); with
act-order, or one group, from the original weights before any update ("static groups"), so the
stored layout is the plain one: scale_GN for the groups of consecutive rows, no index.

`layer_error(w, ŵ, h)` = tr((W - Ŵ)^T H (W - Ŵ)) = ||X W - X Ŵ||^2 over the calibration tokens.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from MaxText.layers.int_levels import group_size_for

BITS = (4, 8)


def qmax(bits: int) -> int:
  return 2 ** (bits - 1) - 1


def group_scales(w_KN: jax.Array, bits: int, gs: int) -> jax.Array:
  """scale_GN: max|w| / qmax per group of `gs` rows and column (1 where the group is all zero)."""
  k, n = w_KN.shape
  amax = jnp.max(jnp.abs(w_KN.reshape(k // gs, gs, n)), axis=1)
  return jnp.where(amax > 0, amax / qmax(bits), 1.0).astype(w_KN.dtype)


def quantize_with(w: jax.Array, scale: jax.Array, bits: int) -> jax.Array:
  """Integer levels (same float dtype) of w for the broadcastable `scale`."""
  return jnp.clip(jnp.round(w / scale), -qmax(bits) - 1, qmax(bits))


@functools.partial(jax.jit, static_argnames=("bits", "group_size"))
def rtn(w_KN: jax.Array, bits: int, group_size: int) -> tuple[jax.Array, jax.Array]:
  """(q_KN int8 levels, scale_GN): round-to-nearest (one program; eagerly, each operation would
  compile on its own)."""
  k, n = w_KN.shape
  gs = group_size_for(k, group_size)
  scale = group_scales(w_KN, bits, gs)
  q = quantize_with(w_KN.reshape(k // gs, gs, n), scale[:, None, :], bits).reshape(k, n)
  return q.astype(jnp.int8), scale


def dequantize(q_KN: jax.Array, scale_GN: jax.Array) -> jax.Array:
  k, n = q_KN.shape
  g = scale_GN.shape[0]
  return (q_KN.reshape(g, k // g, n).astype(scale_GN.dtype) * scale_GN[:, None, :]).reshape(k, n)


def layer_error(w_KN: jax.Array, wq_KN: jax.Array, h_KK: jax.Array) -> jax.Array:
  """||X W - X Ŵ||_F^2 = tr(D^T H D), D = W - Ŵ (H = X^T X)."""
  d = (w_KN - wq_KN).astype(h_KK.dtype)
  return jnp.sum(d * (h_KK @ d))


def upper_inverse_cholesky(h_KK: jax.Array) -> jax.Array:
  """U upper triangular with H^-1 = U^T U."""
  eye = jnp.eye(h_KK.shape[0], dtype=h_KK.dtype)
  h_inv = jax.scipy.linalg.cho_solve((jnp.linalg.cholesky(h_KK), True), eye)
  h_inv = (h_inv + h_inv.T) / 2
  return jnp.linalg.cholesky(h_inv).T


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "act_order", "block_size"))
def gptq(w_KN: jax.Array, h_KK: jax.Array, *, bits: int, group_size: int, act_order: bool,
         damp: float = 0.01, block_size: int = 128) -> tuple[jax.Array, jax.Array]:
  """(q_KN int8 levels, scale_GN) by GPTQ (module docstring). Computes in w's float dtype."""
  k, n = w_KN.shape
  dt = w_KN.dtype
  gs = group_size_for(k, group_size)
  static = act_order or gs == k
  h = h_KK.astype(dt)
  dead = jnp.diag(h) == 0
  h = h + jnp.diag(jnp.where(dead, 1.0, 0.0).astype(dt))
  W = jnp.where(dead[None, :], 0.0, w_KN.T)                   # [N, K]: one row per output
  scale = group_scales(W.T, bits, gs)                         # static groups (used when `static`)
  perm = jnp.argsort(-jnp.diag(h), stable=True) if act_order else jnp.arange(k)
  group_of = perm // gs                                       # group of each processed column
  W, h = W[:, perm], h[perm][:, perm]
  h = h + damp * jnp.mean(jnp.diag(h)) * jnp.eye(k, dtype=dt)
  U = upper_inverse_cholesky(h)
  # blocks never split a group (dynamic group scales need the whole group inside the block)
  bs = k if gs == k else gs * max(1, block_size // gs)
  Q = jnp.zeros((n, k), dt)
  for i1 in range(0, k, bs):
    i2 = min(i1 + bs, k)
    U1 = U[i1:i2, i1:i2]

    def column(i, carry, i1=i1, U1=U1):
      W1, Q1, E1, scale = carry
      col = i1 + i
      if not static:
        fresh = group_scales(jax.lax.dynamic_slice_in_dim(W1, i, gs, axis=1).T, bits, gs)[0]
        scale = jax.lax.cond(col % gs == 0, lambda s: s.at[col // gs].set(fresh),
                             lambda s: s, scale)
      w = W1[:, i]
      s = scale[group_of[col]]
      q = quantize_with(w, s, bits)
      err = (w - q * s) / U1[i, i]
      W1 = W1 - err[:, None] * U1[i][None, :]                 # U upper: columns >= i only
      return W1, Q1.at[:, i].set(q), E1.at[:, i].set(err), scale

    W1, Q1, E1, scale = jax.lax.fori_loop(
        0, i2 - i1, column, (W[:, i1:i2], jnp.zeros((n, i2 - i1), dt),
                             jnp.zeros((n, i2 - i1), dt), scale))
    Q = Q.at[:, i1:i2].set(Q1)
    W = W.at[:, i2:].add(-(E1 @ U[i1:i2, i2:]))               # the lazy update of later columns
  q_KN = jnp.zeros((n, k), dt).at[:, perm].set(Q).T           # back to the original row order
  return q_KN.astype(jnp.int8), scale


def check_bits(bits: int) -> None:
  if bits not in BITS:
    raise ValueError(f"bits={bits}: 8 or 4")
