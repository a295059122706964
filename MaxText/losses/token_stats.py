"""What a token's loss is, from its logits: each position's log-sum-exp and target logit, the
log-probability of the target (and the entropy), the masked sums of cross-entropy + z-loss, and
their gradient with respect to the logits. Every loss path (whole, chunked per batch shard, split
over the vocabulary) is made of these."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def lse_and_target_logit(logits_BSV: jax.Array, targets_BS: jax.Array):
  """(log-sum-exp, target logit) per position, fp32. bf16 logits (`logits_dtype=bfloat16`) are
  read as bf16 by each pass (the max taken in bf16, exact), so the compiler has no fp32 copy of
  them to materialise."""
  target_logit_BS = jnp.take_along_axis(logits_BSV, targets_BS[..., None],
                                        axis=-1)[..., 0].astype(jnp.float32)
  if logits_BSV.dtype == jnp.float32:
    return jax.nn.logsumexp(logits_BSV, axis=-1), target_logit_BS
  max_BS = jax.lax.stop_gradient(jnp.max(logits_BSV, axis=-1)).astype(jnp.float32)
  shifted_BSV = logits_BSV.astype(jnp.float32) - max_BS[..., None]
  return max_BS + jnp.log(jnp.sum(jnp.exp(shifted_BSV), axis=-1)), target_logit_BS


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


def sums_of_stats(lse_BS: jax.Array, target_logit_BS: jax.Array, mask_BS: jax.Array,
                  z_loss_weight: float) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`cross_entropy_sums` from each position's log-sum-exp and target logit (however they were
  computed: whole, or combined across vocabulary slices)."""
  mask = mask_BS.astype(jnp.float32)
  z_BS = z_loss_weight * jnp.square(lse_BS)
  nll = jnp.sum((lse_BS - target_logit_BS + z_BS) * mask)
  return nll, jnp.sum(z_BS * mask), jnp.sum(mask)


def cross_entropy_sums(logits_BSV: jax.Array, targets_BS: jax.Array, mask_BS: jax.Array,
                       z_loss_weight: float) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Sums over unmasked tokens of (cross-entropy + z-loss), of the z-loss alone, and the count.
  Padding and targets across a packed-document boundary have mask 0. Logits narrower than fp32
  (`logits_dtype=bfloat16`) get their cotangent in fp32, rounded to their dtype once
  (`_narrow_sums`), as the chunked loss's (`logits_cotangent`)."""
  if logits_BSV.dtype == jnp.float32:
    return sums_of_stats(*lse_and_target_logit(logits_BSV, targets_BS), mask_BS, z_loss_weight)
  return _narrow_sums(logits_BSV, targets_BS, mask_BS, z_loss_weight)


@jax.custom_vjp
def _narrow_sums(logits_BSV, targets_BS, mask_BS, z_loss_weight):
  """`cross_entropy_sums` of bf16 logits. Autodiff would round the softmax part of the cotangent
  to bf16 (the fp32 cast's transpose) and then add the target's one-hot in bf16 (the gather's):
  two roundings where the target's probability is not small. Here the whole cotangent is formed
  in fp32 and rounded once."""
  return sums_of_stats(*lse_and_target_logit(logits_BSV, targets_BS), mask_BS, z_loss_weight)


def _narrow_sums_fwd(logits_BSV, targets_BS, mask_BS, z_loss_weight):
  lse_BS, target_logit_BS = lse_and_target_logit(logits_BSV, targets_BS)
  return (sums_of_stats(lse_BS, target_logit_BS, mask_BS, z_loss_weight),
          (logits_BSV, lse_BS, targets_BS, mask_BS, z_loss_weight))


def _narrow_sums_bwd(res, g):
  """g = the cotangents of (nll, z-loss sum, count): of the nll, `logits_cotangent`'s expression
  (the same bits where g is (1, 0, ·), the train step's); of the z-loss sum, mask · 2z·lse ·
  softmax; the count has none."""
  logits, lse, targets, mask, z_loss_weight = res
  g_nll, g_z, _ = g
  m = mask.astype(jnp.float32)
  softmax = jnp.exp(logits.astype(jnp.float32) - lse[..., None])
  scale = (m * (g_nll * (1.0 + 2.0 * z_loss_weight * lse) + g_z * (2.0 * z_loss_weight * lse)))
  onehot = jax.nn.one_hot(targets, logits.shape[-1], dtype=jnp.float32)
  cot = scale[..., None] * softmax - (g_nll * m)[..., None] * onehot
  return cot.astype(logits.dtype), None, None, None   # (the z-loss weight: a constant)


_narrow_sums.defvjp(_narrow_sums_fwd, _narrow_sums_bwd)


def logits_cotangent(logits, lse, targets, mask, z_loss_weight):
  """d(Σ mask · (lse − logit[target] + z·lse²)) / d logits, in fp32: mask · ((1 + 2z·lse) ·
  softmax − one-hot), from the logits and their log-sum-exp `lse` over the whole vocabulary (the
  logits may be a vocabulary slice, `targets` relative to it: out of range has no one-hot)."""
  logits = logits.astype(jnp.float32)
  softmax = jnp.exp(logits - lse[..., None])
  scale = (mask.astype(jnp.float32) * (1.0 + 2.0 * z_loss_weight * lse))[..., None]
  onehot = jax.nn.one_hot(targets, logits.shape[-1], dtype=jnp.float32)
  return scale * softmax - mask.astype(jnp.float32)[..., None] * onehot
