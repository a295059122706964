"""What both chunked loss paths share (`loss.py`: per batch shard; `loss_vocab_split.py`: the head
split over the vocabulary): each position's log-sum-exp and target logit and the sums made of them,
the cut into chunks, the head's weights among the parameters, the logits' cotangent, and the custom
VJP that computes the loss's gradient in the forward pass."""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from MaxText.sharding.rules import logical_to_spec


HeadFn = Callable[[Any, jax.Array], jax.Array]   # (params, hidden [..., D]) -> fp32 logits [..., V]


def lse_and_target_logit(logits_BSV: jax.Array, targets_BS: jax.Array):
  logits_BSV = logits_BSV.astype(jnp.float32)
  lse_BS = jax.nn.logsumexp(logits_BSV, axis=-1)
  target_logit_BS = jnp.take_along_axis(logits_BSV, targets_BS[..., None], axis=-1)[..., 0]
  return lse_BS, target_logit_BS


def sums_of_stats(lse_BS: jax.Array, target_logit_BS: jax.Array, mask_BS: jax.Array,
                  z_loss_weight: float) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`cross_entropy_sums` from each position's log-sum-exp and target logit (however they were
  computed: whole, or combined across vocabulary slices)."""
  mask = mask_BS.astype(jnp.float32)
  z_BS = z_loss_weight * jnp.square(lse_BS)
  nll = jnp.sum((lse_BS - target_logit_BS + z_BS) * mask)
  return nll, jnp.sum(z_BS * mask), jnp.sum(mask)


def chunks(x_BS_: jax.Array, chunk: int) -> jax.Array:
  """[B, S, ...] → [n, B, chunk, ...], zero-padded to n·chunk positions."""
  B, S = x_BS_.shape[:2]
  n = -(-S // chunk)
  pad = [(0, 0), (0, n * chunk - S)] + [(0, 0)] * (x_BS_.ndim - 2)
  x = jnp.pad(x_BS_, pad)
  return x.reshape(B, n, chunk, *x_BS_.shape[2:]).swapaxes(0, 1)


def batch_axes(ctx, rows: int) -> tuple[str, ...]:
  """The mesh axes that split a batch of `rows` rows ("activation_batch"), as a tuple."""
  axes = logical_to_spec(("activation_batch",), (rows,), ctx.rules, ctx.mesh)[0]
  return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def used_leaves(head: HeadFn, params, hidden_BcD: jax.Array) -> list[bool]:
  """Which leaves of `params` the head reads (its weights: the gradient is taken for those only,
  not accumulated as zeros for the whole model)."""
  leaves, treedef = jax.tree.flatten(params)
  jaxpr = jax.make_jaxpr(lambda ls, h: head(jax.tree.unflatten(treedef, ls), h))(
      leaves, hidden_BcD).jaxpr
  read = {id(v) for eqn in jaxpr.eqns for v in eqn.invars}
  read |= {id(v) for v in jaxpr.outvars}
  return [id(v) in read for v in jaxpr.invars[:len(leaves)]]


def logits_cotangent(logits, lse, targets, mask, z_loss_weight):
  """d(Σ mask · (lse − logit[target] + z·lse²)) / d logits, in fp32: mask · ((1 + 2z·lse) ·
  softmax − one-hot), from the logits and their log-sum-exp `lse` over the whole vocabulary (the
  logits may be a vocabulary slice, `targets` relative to it: out of range has no one-hot)."""
  logits = logits.astype(jnp.float32)
  softmax = jnp.exp(logits - lse[..., None])
  scale = (mask.astype(jnp.float32) * (1.0 + 2.0 * z_loss_weight * lse))[..., None]
  onehot = jax.nn.one_hot(targets, logits.shape[-1], dtype=jnp.float32)
  return scale * softmax - mask.astype(jnp.float32)[..., None] * onehot


def with_gradient_in_forward(sums_only: Callable, sums_and_grads: Callable) -> Callable:
  """(w, h) -> (loss sum, z-loss sum, count) with a custom VJP: `sums_only(w, h)` is the value,
  `sums_and_grads(w, h)` -> (sums, dw, dh) computes the loss sum's gradients in the forward pass
  and the backward pass only scales them by the incoming cotangent. The z-loss sum and the count
  are metrics (no gradient)."""
  @jax.custom_vjp
  def fused(w, h):
    return sums_only(w, h)

  def fused_fwd(w, h):
    sums, dw, dh = sums_and_grads(w, h)
    return sums, (dw, dh)

  def fused_bwd(res, g):
    dw, dh = res
    g_nll = g[0]
    return (jax.tree.map(lambda d: (g_nll * d).astype(d.dtype), dw),
            (g_nll * dh).astype(dh.dtype))

  fused.defvjp(fused_fwd, fused_bwd)

  def sums(w, h):
    nll, z, n = fused(w, h)
    return nll, jax.lax.stop_gradient(z), jax.lax.stop_gradient(n)
  return sums
