"""The dot-product attention core in bf16 with fp32 softmax, for XLA:CPU.

Heads-major arrays (q [B, K, Q, E] with the G query heads of a kv head folded into Q; k/v
[B, K, T, E]) and a boolean mask [B, 1, Q, T]. Written with autodiff, the backward pass of the
bf16 attention multiplies fp32 cotangents with bf16 operands, so XLA:CPU converts every operand to
fp32 (and runs two of the five batched dots outside YNNPACK, whose bf16 kernels want the
contracted axis last on the left). The custom VJP keeps all five dots in bf16 with fp32
accumulation, in the layouts YNNPACK takes, and saves only the output and the per-row
log-sum-exp: the probabilities are recomputed from them (as in flash attention).

Its residuals (the row-major heads-major q, k, v, the output and the log-sum-exp) carry the name
`RESIDUALS`, which the `save_matmuls` remat policy keeps: the backward pass of a rematerialised
layer then neither recomputes the attention forward nor RoPE and the transposes to the heads-major
layout, which would otherwise run twice per step.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from MaxText.layers.linear import concat_bits, row_major, row_major_transpose
from MaxText.layers.saved import saved_residual

RESIDUALS = "attention_residuals"   # checkpoint_name of the saved q, k, v, output, log-sum-exp


def _bdot(a: jax.Array, b: jax.Array, contract: tuple[int, int]) -> jax.Array:
  """Batched (over the leading B, K axes) dot, fp32 accumulation."""
  return jax.lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((0, 1), (0, 1))),
                             preferred_element_type=jnp.float32)


Blocks = tuple[tuple[int, int, int, int], ...]   # (first row, end row, first key, end key) each


def _scores(q, k, mask, scale):
  s = _bdot(q, k, (3, 3)) * scale                                  # [B, K, Q, T] fp32
  return jnp.where(mask, s, jnp.finfo(jnp.float32).min)


def _forward_block(q, k, v, mask, scale):
  s = _scores(q, k, mask, scale)
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.exp(s - m)
  l = jnp.sum(p, axis=-1, keepdims=True)
  o = (_bdot(p.astype(v.dtype), v, (3, 2)) / l).astype(q.dtype)   # [B, K, Q, E]
  return o, (m + jnp.log(l))[..., 0]                               # lse [B, K, Q]


def _block_args(blocks: Blocks | None, q, k, v, mask):
  """Per block: (its rows of q, its keys of k and v, its part of the mask) and its bounds."""
  Q, T = q.shape[2], k.shape[2]
  for r0, r1, t0, t1 in blocks or ((0, Q, 0, T),):
    yield ((q[:, :, r0:r1], k[:, :, t0:t1], v[:, :, t0:t1], mask[:, :, r0:r1, t0:t1]),
           (r0, r1, t0, t1))


def _forward(q, k, v, mask, scale, blocks) -> tuple[jax.Array, jax.Array]:
  outs = [_forward_block(*args, scale) for args, _ in _block_args(blocks, q, k, v, mask)]
  if len(outs) == 1:
    return outs[0]
  return concat_bits([o for o, _ in outs], 2), jnp.concatenate([l for _, l in outs], axis=2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def attention_core(q_BKQE, k_BKTE, v_BKTE, mask_B1QT, scale: float, blocks: Blocks | None = None
                   ) -> jax.Array:
  """softmax(q k^T * scale, masked) v → [B, K, Q, E] in q's dtype. The caller passes row-major
  q, k, v (`linear.row_major`: the heads-major arrays come from transposes). `blocks` (static):
  rows of q that attend only to a range of keys, e.g. causal query blocks that skip the keys after
  their last row (every key outside a block's range must be masked for its rows); None: one
  block, every row over every key."""
  return _forward(q_BKQE, k_BKTE, v_BKTE, mask_B1QT, scale, blocks)[0]


def _fwd(q, k, v, mask, scale, blocks):
  o, lse = _forward(q, k, v, mask, scale, blocks)
  q, k, v, o, lse = (saved_residual(a, RESIDUALS) for a in (q, k, v, o, lse))
  return o, (q, k, v, mask, o, lse)


def _backward_block(q, k, v, mask, o, lse, do, scale):
  """(dq, dk, dv) of one block, fp32."""
  p = jnp.exp(_scores(q, k, mask, scale) - lse[..., None])         # fp32 probabilities
  dv = _bdot(row_major_transpose(p.astype(v.dtype)), do, (3, 2))   # [B, K, T, E]
  dp = _bdot(do, v, (3, 3))                                        # [B, K, Q, T]
  rowdot = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1, keepdims=True)
  ds = (p * (dp - rowdot) * scale).astype(q.dtype)
  dq = _bdot(ds, k, (3, 2))
  dk = _bdot(row_major_transpose(ds), q, (3, 2))
  return dq, dk, dv


def _bwd(scale, blocks, res, do):
  q, k, v, mask, o, lse = res
  do = row_major(do.astype(q.dtype))      # arrives through the output's transposes
  dqs, dk, dv = [], None, None
  # last block first: causal, it spans every key, so its dk/dv start the sums
  for args, (r0, r1, t0, t1) in reversed(list(_block_args(blocks, q, k, v, mask))):
    dq_b, dk_b, dv_b = _backward_block(*args, o[:, :, r0:r1], lse[:, :, r0:r1],
                                       do[:, :, r0:r1], scale)
    dqs.insert(0, dq_b.astype(q.dtype))
    if dk is None and (t0, t1) == (0, k.shape[2]):
      dk, dv = dk_b, dv_b
    else:   # the keys' gradients summed over the blocks in fp32
      dk = (jnp.zeros(k.shape, jnp.float32) if dk is None else dk).at[:, :, t0:t1].add(dk_b)
      dv = (jnp.zeros(v.shape, jnp.float32) if dv is None else dv).at[:, :, t0:t1].add(dv_b)
  dq = dqs[0] if len(dqs) == 1 else concat_bits(dqs, 2)
  assert dk is not None and dv is not None   # (at least one block)
  return dq, dk.astype(k.dtype), dv.astype(v.dtype), None


attention_core.defvjp(_fwd, _bwd)
