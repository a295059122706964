"""The token loss of a micro-batch: masked cross-entropy (+ z-loss), whole or chunked.

Chunked (`loss_chunk_length` = c > 0, shorter than the sequence): the model returns its final-norm
hidden state [B, S, D] (`ModelDef.apply_hidden`) and the loss applies its LM head
(`ModelDef.head`) to c positions at a time: the sequence is cut into ceil(S / c) chunks and a
`lax.scan` runs head + cross-entropy on one [B, c, D] chunk at a time, so only one chunk's fp32
logits [B, c, V] exist at once instead of [B, S, V]. The loss's gradient is computed in the same
pass (a custom VJP): per chunk, the logits' gradient (softmax − one-hot, with the z-loss term)
goes straight through the head's own VJP, the head's parameter gradient is summed over the chunks
and the hidden state's gradient kept; the backward pass only scales both by the incoming
cotangent. So the head's three matmuls run once each, on chunks small enough to stay in cache
(on XLA:CPU cheaper than the whole sequence's: its fp32 logits are no longer written to and read
back from memory).
Positions past S (padding of the last chunk) have mask 0. Only the loss sum carries a gradient:
the z-loss sum and the token count are metrics (stop_gradient).

Under a mesh the chunk loop runs inside a `shard_map` over the axes that split the batch, in one
of two ways:
- split over the vocabulary (when the batch's tokens are at most the vocabulary, the mesh's
  only axes of size > 1 split the batch and those divide the vocabulary): each device holds a
  vocabulary slice of the head weights and the hidden rows of the whole batch
  (`loss_vocab_split.py`, with the token log-probabilities' split for RL).
- else per batch shard: each device loops over its own rows; the head weights are gathered once
  before the loop and their gradient reduced once after it (a scan over globally sharded chunks
  would gather the head and reduce its gradient once per chunk). Axes that do not split the batch
  (tensor: the vocabulary) stay automatic.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from MaxText.losses.loss_parts import (HeadFn, batch_axes, chunks, logits_cotangent,
                                       lse_and_target_logit, sums_of_stats, used_leaves,
                                       with_gradient_in_forward)
from MaxText.losses.loss_vocab_split import (vocab_split_log_probs, vocab_split_plan,
                                             vocab_split_sums)
from MaxText.models.model_def import ModelDef
from MaxText.sharding.rules import current_context, without_rules


def target_log_probs(logits_BSV: jax.Array, targets_BS: jax.Array) -> jax.Array:
  """log p(target) [B, S] in fp32."""
  lse_BS, target_logit_BS = lse_and_target_logit(logits_BSV, targets_BS)
  return target_logit_BS - lse_BS


def target_log_probs_and_entropy(logits_BSV: jax.Array, targets_BS: jax.Array
                                 ) -> tuple[jax.Array, jax.Array]:
  """(log p(target) [B, S], the entropy of the distribution at each position [B, S]), fp32."""
  logits_BSV = logits_BSV.astype(jnp.float32)
  lse_BS, target_logit_BS = lse_and_target_logit(logits_BSV, targets_BS)
  probs_BSV = jnp.exp(logits_BSV - lse_BS[..., None])
  return target_logit_BS - lse_BS, lse_BS - jnp.sum(probs_BSV * logits_BSV, axis=-1)


def cross_entropy_sums(logits_BSV: jax.Array, targets_BS: jax.Array, mask_BS: jax.Array,
                       z_loss_weight: float) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Sums over unmasked tokens of (cross-entropy + z-loss), of the z-loss alone, and the count.
  Padding and targets across a packed-document boundary have mask 0."""
  return sums_of_stats(*lse_and_target_logit(logits_BSV, targets_BS), mask_BS, z_loss_weight)


def _per_batch_shard(fn: Callable, params, *batch_arrays: jax.Array):
  """fn(params, *batch_arrays) run per shard of the batch axes under a mesh (`use_rules`); its
  outputs are sums, added over the shards. Without a mesh: fn itself."""
  ctx = current_context()
  if ctx is None:
    return fn(params, *batch_arrays)
  axes = batch_axes(ctx, batch_arrays[0].shape[0])
  if not axes:
    return fn(params, *batch_arrays)

  def local(p, *arrays):
    # the weights as per-device values: their gradient is then summed over the shards once, here,
    # instead of at each use inside fn's loop
    p = jax.tree.map(lambda x: jax.lax.pcast(x, axes, to="varying"), p)
    with without_rules():
      sums = fn(p, *arrays)
    return jax.tree.map(lambda x: jax.lax.psum(x, axes), sums)

  row_spec = P(axes)
  return jax.shard_map(local, mesh=ctx.mesh, axis_names=frozenset(axes),
                       in_specs=(P(), *(row_spec,) * len(batch_arrays)),
                       out_specs=P())(params, *batch_arrays)


def chunked_cross_entropy_sums(head: HeadFn, params, hidden_BSD: jax.Array,
                               targets_BS: jax.Array, mask_BS: jax.Array, z_loss_weight: float,
                               chunk: int, logical_axes=None
                               ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`cross_entropy_sums(head(params, hidden), …)` without materialising all the logits, its
  gradient computed chunk by chunk in the forward pass (module docstring). `logical_axes` (the
  parameters' logical axis names): when given, the head may run split over the vocabulary under
  the batch axes (module docstring)."""
  if chunk <= 0 or chunk >= hidden_BSD.shape[1]:
    return cross_entropy_sums(head(params, hidden_BSD), targets_BS, mask_BS, z_loss_weight)
  plan = vocab_split_plan(head, params, logical_axes, hidden_BSD, chunk)
  if plan is not None:
    return vocab_split_sums(plan, head, params, hidden_BSD, targets_BS, mask_BS, z_loss_weight,
                            chunk)

  def local(p, h_BSD, t_BS, m_BS):
    leaves, treedef = jax.tree.flatten(p)
    used = used_leaves(head, p, h_BSD[:, :chunk])
    w = [x for x, u in zip(leaves, used) if u]              # the head's weights
    rest = [x for x, u in zip(leaves, used) if not u]

    def head_w(w_, h_):
      it_w, it_rest = iter(w_), iter(rest)
      return head(jax.tree.unflatten(treedef, [next(it_w) if u else next(it_rest) for u in used]), h_)

    xs = (chunks(t_BS, chunk), chunks(m_BS, chunk))

    def sums_and_grads(w_, h_):
      def one_chunk(dw, inp):
        h_BcD, t_Bc, m_Bc = inp
        logits, pullback = jax.vjp(head_w, w_, h_BcD)
        lse, t_logit = lse_and_target_logit(logits, t_Bc)
        sums = sums_of_stats(lse, t_logit, m_Bc, z_loss_weight)
        dw_c, dh_BcD = pullback(logits_cotangent(logits, lse, t_Bc, m_Bc, z_loss_weight)
                                .astype(logits.dtype))
        return jax.tree.map(jnp.add, dw, dw_c), (sums, dh_BcD)

      dw0 = jax.tree.map(jnp.zeros_like, w_)
      dw, (sums_n, dh_nBcD) = jax.lax.scan(one_chunk, dw0, (chunks(h_, chunk), *xs))
      B, S = h_.shape[:2]
      dh_BSD = dh_nBcD.swapaxes(0, 1).reshape(B, -1, h_.shape[-1])[:, :S]
      return jax.tree.map(jnp.sum, sums_n), dw, dh_BSD

    def sums_only(w_, h_):
      def one_chunk(_, inp):
        h_BcD, t_Bc, m_Bc = inp
        return None, cross_entropy_sums(head_w(w_, h_BcD), t_Bc, m_Bc, z_loss_weight)
      _, sums_n = jax.lax.scan(one_chunk, None, (chunks(h_, chunk), *xs))
      return jax.tree.map(jnp.sum, sums_n)

    return with_gradient_in_forward(sums_only, sums_and_grads)(w, h_BSD)

  return _per_batch_shard(local, params, hidden_BSD, targets_BS, mask_BS)


def chunked_target_log_probs(head: HeadFn, params, hidden_BSD: jax.Array, targets_BS: jax.Array,
                             chunk: int, entropy: bool = False, logical_axes=None):
  """log p(target) [B, S] (e.g. a policy's token log-probabilities) chunk by chunk, as above, with
  the same value and gradient as the whole; `entropy`: (log p, the entropy per position [B, S]).
  `logical_axes` (the parameters' logical axis names): when given, the head may run split over
  the vocabulary under the batch axes, under the same conditions as the loss (module docstring)."""
  B, S = targets_BS.shape
  per_chunk = target_log_probs_and_entropy if entropy else target_log_probs
  if chunk <= 0 or chunk >= S:
    return per_chunk(head(params, hidden_BSD), targets_BS)
  plan = vocab_split_plan(head, params, logical_axes, hidden_BSD, chunk)
  if plan is not None:
    return vocab_split_log_probs(plan, head, params, hidden_BSD, targets_BS, chunk, entropy)

  @jax.checkpoint
  def one_chunk(_, xs):
    return None, per_chunk(head(params, xs[0]), xs[1])

  _, out_nBc = jax.lax.scan(one_chunk, None, (chunks(hidden_BSD, chunk), chunks(targets_BS, chunk)))
  return jax.tree.map(lambda x: x.swapaxes(0, 1).reshape(B, -1)[:, :S], out_nBc)


def token_loss_sums(model_def: ModelDef, params, micro: dict, *, z_loss_weight: float,
                    chunk: int) -> tuple[jax.Array, jax.Array, jax.Array, dict]:
  """(loss sum, z-loss sum, token count, the model's auxiliary outputs) of one micro-batch."""
  args = (micro["inputs"], micro["inputs_position"], micro["inputs_segmentation"])
  mask_BS = micro["targets_segmentation"] != 0
  if chunk <= 0:
    logits_BSV, aux = model_def.apply_with_aux(params, *args)
    return (*cross_entropy_sums(logits_BSV, micro["targets"], mask_BS, z_loss_weight), aux)
  hidden_BSD, aux = model_def.apply_hidden(params, *args)
  return (*chunked_cross_entropy_sums(model_def.head, params, hidden_BSD, micro["targets"],
                                      mask_BS, z_loss_weight, chunk, model_def.logical_axes), aux)
