"""The distillation loss of a student against a teacher on the same tokens: a divergence between
the two models' next-token distributions, mixed with the student's cross-entropy on the hard
labels, with the teacher's logits computed chunk by chunk over the sequence.

Per target position (the mask: the train step's, `targets_segmentation != 0`), with
p = softmax(teacher logits / T), q = softmax(student logits / T):
  forward_kl   KL(p || q) = Σ p (log p - log q)
  reverse_kl   KL(q || p)
  jsd          the generalized Jensen-Shannon divergence of GKD (Agarwal et al. 2024), as TRL's
               `GKDTrainer.generalized_jsd_loss`: with m = β p + (1 - β) q,
               β KL(p || m) + (1 - β) KL(q || m); β = 0 is forward_kl, β = 1 reverse_kl (as TRL)
each times T² (Hinton et al.: the gradient's scale does not change with T), and
  loss = α · divergence + (1 - α) · cross-entropy(student logits at T = 1, target)
summed over the masked positions (`distill_sums`: sums, divided by the step's token count by the
caller, so micro-batches add up to the step's mean exactly). The teacher gets no gradient.

Chunked (`chunk` = c > 0, shorter than the sequence), as `chunked.py`'s token loss: both models
return their final-norm hidden states [B, S, D_s] / [B, S, D_t] and a `lax.scan` applies the two
heads to c positions at a time, so only one chunk's fp32 logits of each model [B, c, V] exist at
once, never [B, S, V]. The student's gradient is computed in the same pass (`with_gradient_in_forward`):
per chunk the logits' gradient goes through the student head's VJP, and the teacher's logits are
computed once. Under a mesh the loop runs per batch shard (`chunking.per_batch_shard`; the
vocabulary split of `vocab_split.py` is not used here: the divergence needs both models' whole
distributions).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from MaxText.losses.chunking import chunks, per_batch_shard, with_gradient_in_forward
from MaxText.models.model_def import Head

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")


@dataclasses.dataclass(frozen=True)
class DistillSpec:
  """The loss's settings (config keys distill_loss, distill_beta, distill_temperature,
  distill_alpha)."""
  divergence: str = "forward_kl"
  beta: float = 0.5
  temperature: float = 1.0
  alpha: float = 0.5

  def __post_init__(self):
    if self.divergence not in DIVERGENCES:
      raise ValueError(f"distill_loss={self.divergence!r}: one of {', '.join(DIVERGENCES)}")


def _kl(log_a: jax.Array, log_b: jax.Array) -> jax.Array:
  """KL(a || b) over the last axis from log-probabilities."""
  return jnp.sum(jnp.exp(log_a) * (log_a - log_b), axis=-1)


def divergence(student_logits: jax.Array, teacher_logits: jax.Array, spec: DistillSpec
               ) -> jax.Array:
  """Per position [...]: the divergence of `spec` between the teacher's and the student's
  distributions at temperature T, times T² (module docstring)."""
  T = spec.temperature
  log_q = jax.nn.log_softmax(student_logits.astype(jnp.float32) / T, axis=-1)
  log_p = jax.nn.log_softmax(teacher_logits.astype(jnp.float32) / T, axis=-1)
  beta = spec.beta
  if spec.divergence == "forward_kl" or (spec.divergence == "jsd" and beta == 0.0):
    out = _kl(log_p, log_q)
  elif spec.divergence == "reverse_kl" or (spec.divergence == "jsd" and beta == 1.0):
    out = _kl(log_q, log_p)
  else:
    log_m = jnp.logaddexp(log_p + math.log(beta), log_q + math.log(1.0 - beta))
    out = beta * _kl(log_p, log_m) + (1.0 - beta) * _kl(log_q, log_m)
  return out * (T * T)


def token_sums(student_logits: jax.Array, teacher_logits: jax.Array, targets: jax.Array,
               mask: jax.Array, spec: DistillSpec
               ) -> tuple[jax.Array, tuple[jax.Array, jax.Array], jax.Array]:
  """(Σ mask·loss, (Σ mask·divergence, Σ mask·cross-entropy), Σ mask) of logits [..., V]."""
  m = mask.astype(jnp.float32)
  s = student_logits.astype(jnp.float32)
  div = divergence(s, jax.lax.stop_gradient(teacher_logits), spec)
  lse = jax.nn.logsumexp(s, axis=-1)
  target_logit = jnp.take_along_axis(s, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
  kd, ce = jnp.sum(div * m), jnp.sum((lse - target_logit) * m)
  return spec.alpha * kd + (1.0 - spec.alpha) * ce, (kd, ce), jnp.sum(m)


def head_only(head: Head, params):
  """`params` with every leaf the head does not read replaced by a scalar: what the teacher's
  head takes into the per-shard loop (its layers stay where they are)."""
  leaves, treedef = jax.tree.flatten(params)
  return jax.tree.unflatten(treedef, [x if u else jnp.zeros((), x.dtype)
                                      for x, u in zip(leaves, head.reads(params))])


def distill_sums(head: Head, params, hidden_BSD: jax.Array, teacher_head: Head, teacher_params,
                 teacher_hidden_BSD: jax.Array, targets_BS: jax.Array, mask_BS: jax.Array,
                 spec: DistillSpec, chunk: int):
  """(loss sum, (divergence sum, cross-entropy sum), token count) of a batch from the student's
  hidden state (with `params` and its `head`) and the teacher's (module docstring). Only the loss
  sum carries a gradient (to the student's head weights and hidden state)."""
  teacher_hidden_BSD = jax.lax.stop_gradient(teacher_hidden_BSD)
  teacher_params = jax.lax.stop_gradient(teacher_params)
  if chunk <= 0 or chunk >= hidden_BSD.shape[1]:
    loss, stats, n = token_sums(head(params, hidden_BSD),
                                teacher_head(teacher_params, teacher_hidden_BSD), targets_BS,
                                mask_BS, spec)
    return loss, jax.lax.stop_gradient(stats), jax.lax.stop_gradient(n)

  def local(p, h_BSD, th_BSD, t_BS, m_BS):
    sp, tp = p
    leaves, treedef = jax.tree.flatten(sp)
    used = head.reads(sp)
    w = [x for x, u in zip(leaves, used) if u]              # the student head's weights
    rest = [x for x, u in zip(leaves, used) if not u]

    def head_w(w_, h_):
      it_w, it_rest = iter(w_), iter(rest)
      return head(jax.tree.unflatten(treedef, [next(it_w) if u else next(it_rest) for u in used]),
                  h_)

    xs = (chunks(th_BSD, chunk), chunks(t_BS, chunk), chunks(m_BS, chunk))

    def sums_and_grads(w_, h_):
      def one_chunk(dw, inp):
        h_BcD, th_BcD, t_Bc, m_Bc = inp
        logits, pullback = jax.vjp(head_w, w_, h_BcD)
        t_logits = teacher_head(tp, th_BcD)
        (loss, (stats, n)), dlogits = jax.value_and_grad(
            lambda lg: (lambda r: (r[0], (r[1], r[2])))(token_sums(lg, t_logits, t_Bc, m_Bc,
                                                                   spec)),
            has_aux=True)(logits)
        dw_c, dh_BcD = pullback(dlogits.astype(logits.dtype))
        return jax.tree.map(jnp.add, dw, dw_c), ((loss, stats, n), dh_BcD)

      dw0 = jax.tree.map(jnp.zeros_like, w_)
      dw, (sums_n, dh_nBcD) = jax.lax.scan(one_chunk, dw0, (chunks(h_, chunk), *xs))
      B, S = h_.shape[:2]
      dh_BSD = dh_nBcD.swapaxes(0, 1).reshape(B, -1, h_.shape[-1])[:, :S]
      return jax.tree.map(jnp.sum, sums_n), dw, dh_BSD

    def sums_only(w_, h_):
      def one_chunk(_, inp):
        h_BcD, th_BcD, t_Bc, m_Bc = inp
        return None, token_sums(head_w(w_, h_BcD), teacher_head(tp, th_BcD), t_Bc, m_Bc, spec)
      _, sums_n = jax.lax.scan(one_chunk, None, (chunks(h_, chunk), *xs))
      return jax.tree.map(jnp.sum, sums_n)

    return with_gradient_in_forward(sums_only, sums_and_grads)(w, h_BSD)

  return per_batch_shard(local, (params, head_only(teacher_head, teacher_params)), hidden_BSD,
                         teacher_hidden_BSD, targets_BS, mask_BS)
