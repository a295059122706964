"""The token loss of a micro-batch: masked cross-entropy (+ z-loss), whole or chunked.

Chunked (`loss_chunk_length` = c > 0, shorter than the sequence): the model returns its final-norm
hidden state [B, S, D] (`ModelDef.apply_hidden`) and the loss applies its LM head
(`ModelDef.head`) to c positions at a time: the sequence is cut into ceil(S / c) chunks and a
`lax.scan` runs head + cross-entropy on one [B, c, D] chunk at a time under `jax.checkpoint`, so
only one chunk's fp32 logits [B, c, V] (and, in the backward pass, their gradient) exist at once
instead of [B, S, V]. The price: the head's forward matmul runs twice (once more in the backward
pass), ~1/3 more head FLOPs. Positions past S (padding of the last chunk) have mask 0.

Under a mesh the chunk loop runs inside a `shard_map` over the axes that split the batch, so each
device loops over its own rows: the head weights are gathered once before the loop and their
gradient reduced once after it (a scan over globally sharded chunks would gather the head and
reduce its gradient once per chunk). Axes that do not split the batch (tensor: the vocabulary)
stay automatic.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from MaxText.sharding.rules import current_context, logical_to_spec, without_rules
from MaxText.models.model_def import ModelDef

HeadFn = Callable[[Any, jax.Array], jax.Array]   # (params, hidden [..., D]) -> fp32 logits [..., V]


def _lse_and_target_logit(logits_BSV: jax.Array, targets_BS: jax.Array):
  logits_BSV = logits_BSV.astype(jnp.float32)
  lse_BS = jax.nn.logsumexp(logits_BSV, axis=-1)
  target_logit_BS = jnp.take_along_axis(logits_BSV, targets_BS[..., None], axis=-1)[..., 0]
  return lse_BS, target_logit_BS


def target_log_probs(logits_BSV: jax.Array, targets_BS: jax.Array) -> jax.Array:
  """log p(target) [B, S] in fp32."""
  lse_BS, target_logit_BS = _lse_and_target_logit(logits_BSV, targets_BS)
  return target_logit_BS - lse_BS


def target_log_probs_and_entropy(logits_BSV: jax.Array, targets_BS: jax.Array
                                 ) -> tuple[jax.Array, jax.Array]:
  """(log p(target) [B, S], the entropy of the distribution at each position [B, S]), fp32."""
  logits_BSV = logits_BSV.astype(jnp.float32)
  lse_BS, target_logit_BS = _lse_and_target_logit(logits_BSV, targets_BS)
  probs_BSV = jnp.exp(logits_BSV - lse_BS[..., None])
  return target_logit_BS - lse_BS, lse_BS - jnp.sum(probs_BSV * logits_BSV, axis=-1)


def cross_entropy_sums(logits_BSV: jax.Array, targets_BS: jax.Array, mask_BS: jax.Array,
                       z_loss_weight: float) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Sums over unmasked tokens of (cross-entropy + z-loss), of the z-loss alone, and the count.
  Padding and targets across a packed-document boundary have mask 0."""
  lse_BS, target_logit_BS = _lse_and_target_logit(logits_BSV, targets_BS)
  mask = mask_BS.astype(jnp.float32)
  z_BS = z_loss_weight * jnp.square(lse_BS)
  nll = jnp.sum((lse_BS - target_logit_BS + z_BS) * mask)
  return nll, jnp.sum(z_BS * mask), jnp.sum(mask)


def _chunks(x_BS_: jax.Array, chunk: int) -> jax.Array:
  """[B, S, ...] → [n, B, chunk, ...], zero-padded to n·chunk positions."""
  B, S = x_BS_.shape[:2]
  n = -(-S // chunk)
  pad = [(0, 0), (0, n * chunk - S)] + [(0, 0)] * (x_BS_.ndim - 2)
  x = jnp.pad(x_BS_, pad)
  return x.reshape(B, n, chunk, *x_BS_.shape[2:]).swapaxes(0, 1)


def _per_batch_shard(fn: Callable, params, *batch_arrays: jax.Array):
  """fn(params, *batch_arrays) run per shard of the batch axes under a mesh (`use_rules`); its
  outputs are sums, added over the shards. Without a mesh: fn itself."""
  ctx = current_context()
  if ctx is None:
    return fn(params, *batch_arrays)
  B = batch_arrays[0].shape[0]
  axes = logical_to_spec(("activation_batch",), (B,), ctx.rules, ctx.mesh)[0]
  axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
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
                               chunk: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`cross_entropy_sums(head(params, hidden), …)` without materialising all the logits."""
  if chunk <= 0 or chunk >= hidden_BSD.shape[1]:
    return cross_entropy_sums(head(params, hidden_BSD), targets_BS, mask_BS, z_loss_weight)

  def local(p, h_BSD, t_BS, m_BS):
    @jax.checkpoint
    def one_chunk(h_BcD, t_Bc, m_Bc):
      return cross_entropy_sums(head(p, h_BcD), t_Bc, m_Bc, z_loss_weight)

    xs = (_chunks(h_BSD, chunk), _chunks(t_BS, chunk), _chunks(m_BS, chunk))
    _, sums_n = jax.lax.scan(lambda _, xs: (None, one_chunk(*xs)), None, xs)
    return jax.tree.map(jnp.sum, sums_n)

  return _per_batch_shard(local, params, hidden_BSD, targets_BS, mask_BS)


def chunked_target_log_probs(head: HeadFn, params, hidden_BSD: jax.Array, targets_BS: jax.Array,
                             chunk: int, entropy: bool = False):
  """log p(target) [B, S] (e.g. a policy's token log-probabilities) chunk by chunk, as above, with
  the same value and gradient as the whole; `entropy`: (log p, the entropy per position [B, S])."""
  B, S = targets_BS.shape
  per_chunk = target_log_probs_and_entropy if entropy else target_log_probs
  if chunk <= 0 or chunk >= S:
    return per_chunk(head(params, hidden_BSD), targets_BS)

  @jax.checkpoint
  def one_chunk(_, xs):
    return None, per_chunk(head(params, xs[0]), xs[1])

  _, out_nBc = jax.lax.scan(one_chunk, None, (_chunks(hidden_BSD, chunk), _chunks(targets_BS, chunk)))
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
                                      mask_BS, z_loss_weight, chunk), aux)
