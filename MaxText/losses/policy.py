"""The clipped policy-gradient loss of GRPO / PPO and the group advantages, pure JAX (GRPO's
objective, MaxText/methods/grpo.py, and MaxText/rl/ read them here).

Conventions: B sequences (rows), T response positions, G completions per prompt (a group: G
consecutive rows). `mask_BT` marks the response tokens that count (1) — prompt, padding and
positions after the end are 0. Log-probabilities are of the chosen tokens, fp32.

policy_loss, per token (r = exp(clamp(logp − old, ±LOG_RATIO_CLAMP)), A the advantage):
    pg   = max(−A·r, −A·clip(r, 1 − epsilon_low, 1 + epsilon_high))          PPO's clipped surrogate
    pg   = min(pg, −A·dual_clip)  where A < 0                                 dual clip (c > 1)
    loss = pg + beta·kl,   kl = k1: logp − ref;  k2: ½(logp − ref)²;  k3: exp(ref − logp) − (ref − logp) − 1
then aggregated over the masked tokens:
    token-mean            Σ loss·mask / Σ mask                               (every token weighs the same)
    seq-mean-token-mean   mean over rows of (Σ_t loss·mask / Σ_t mask)        (GRPO's paper)
    seq-mean-token-sum    mean over rows of Σ_t loss·mask
    seq-mean-token-scale  mean over rows of Σ_t loss·mask / max_response_len  (Dr. GRPO: no length bias)
With `importance_sampling="sequence"` (GSPO, Zheng et al. 2025; TRL's importance_sampling_level)
every token of a row takes the row's one ratio r = exp(clamp(mean over its masked tokens of
(logp − old))): the clip acts on the whole sequence.
DAPO's dynamic sampling (`informative_rows`: the groups whose rewards are all equal taken out of
the loss, as if dropped) and overlong reward shaping (`overlong_penalty`) act on the rollout before
the loss.
"mean over rows" counts the rows with at least one response token (a row without any, e.g. a
padding row, neither adds nor dilutes); `max_response_len` None means T. The log-ratio is clamped
before `exp` so a far-off-policy token cannot overflow the ratio to inf (its gradient is then 0,
as the clipped surrogate's would be).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

LOG_RATIO_CLAMP = 20.0
KL_ESTIMATORS = ("k1", "k2", "k3")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-scale")
ADVANTAGE_ESTIMATORS = ("grpo", "drgrpo", "rloo")
IMPORTANCE_SAMPLING = ("token", "sequence")
ZERO_STD = 1e-6     # a group whose rewards' std is below this has no signal: advantage 0


def kl_penalty(logprobs_BT: jax.Array, ref_logprobs_BT: jax.Array, estimator: str) -> jax.Array:
  """Per-token estimate of KL(policy ‖ reference) from the sampled tokens' log-probabilities."""
  diff_BT = logprobs_BT - ref_logprobs_BT
  if estimator == "k1":
    return diff_BT
  if estimator == "k2":
    return 0.5 * jnp.square(diff_BT)
  if estimator == "k3":
    return jnp.exp(-diff_BT) + diff_BT - 1.0
  raise ValueError(f"kl_estimator={estimator!r}: one of {KL_ESTIMATORS}")


def aggregate(loss_BT: jax.Array, mask_BT: jax.Array, aggregation: str,
              max_response_len: int | None = None, totals: dict | None = None) -> jax.Array:
  """One scalar from per-token values (module docstring). `totals` ({"tokens", "rows"}, of a
  whole batch of which these rows are a micro-batch: `batch_totals`): the denominators of the
  means, so that the micro-batches' results add up to the whole batch's."""
  mask_BT = mask_BT.astype(jnp.float32)
  total_B = jnp.sum(loss_BT * mask_BT, axis=-1)
  count_B = jnp.sum(mask_BT, axis=-1)
  totals = totals or batch_totals(mask_BT)
  if aggregation == "token-mean":
    return jnp.sum(total_B) / jnp.maximum(totals["tokens"], 1.0)
  rows = jnp.maximum(totals["rows"], 1.0)
  if aggregation == "seq-mean-token-mean":
    per_row_B = total_B / jnp.maximum(count_B, 1.0)
  elif aggregation == "seq-mean-token-sum":
    per_row_B = total_B
  elif aggregation == "seq-mean-token-scale":
    per_row_B = total_B / float(max_response_len or loss_BT.shape[-1])
  else:
    raise ValueError(f"aggregation={aggregation!r}: one of {AGGREGATIONS}")
  return jnp.sum(per_row_B) / rows


def batch_totals(mask_BT: jax.Array) -> dict[str, jax.Array]:
  """The denominators of a batch's means: its (weighted) response tokens and the rows with any."""
  mask_BT = mask_BT.astype(jnp.float32)
  return {"tokens": jnp.sum(mask_BT),
          "rows": jnp.sum(jnp.sum(mask_BT, axis=-1) > 0).astype(jnp.float32)}


def policy_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, *, epsilon_low=0.2,
                epsilon_high=0.2, dual_clip=None, beta=0.0, kl_estimator="k3",
                aggregation="token-mean", max_response_len=None, totals=None,
                importance_sampling="token"):
  """(loss, metrics) of one batch: arrays [B, T] (advantages [B] or [B, T]); `ref_logprobs` may
  be None when beta is 0 (no KL term, no KL metric). Gradients flow through `logprobs` only.
  Metrics (token means over the mask, no gradient): clip_frac_low (A < 0 and r below
  1 − epsilon_low), clip_frac_high (A > 0 and r above 1 + epsilon_high), dual_clip_frac, kl,
  ratio_mean / ratio_min / ratio_max, pg_loss (the aggregated surrogate without the KL term).
  `totals`: the whole batch's denominators when these rows are one micro-batch of it (`aggregate`):
  the loss and every metric but ratio_min / ratio_max then add up over the micro-batches."""
  if kl_estimator not in KL_ESTIMATORS:
    raise ValueError(f"kl_estimator={kl_estimator!r}: one of {KL_ESTIMATORS}")
  if dual_clip is not None and dual_clip <= 1.0:
    raise ValueError(f"dual_clip={dual_clip} must be > 1 (or None)")
  if beta and ref_logprobs is None:
    raise ValueError(f"beta={beta} needs ref_logprobs")
  if importance_sampling not in IMPORTANCE_SAMPLING:
    raise ValueError(f"importance_sampling={importance_sampling!r}: one of {IMPORTANCE_SAMPLING}")
  logprobs = logprobs.astype(jnp.float32)
  old = jax.lax.stop_gradient(old_logprobs.astype(jnp.float32))
  adv_BT = jnp.asarray(advantages, jnp.float32)
  if adv_BT.ndim == 1:
    adv_BT = adv_BT[:, None]
  adv_BT = jnp.broadcast_to(jax.lax.stop_gradient(adv_BT), logprobs.shape)
  mask_BT = mask.astype(jnp.float32)

  log_ratio_BT = logprobs - old
  if importance_sampling == "sequence":   # GSPO: the row's mean log-ratio on every token
    log_ratio_B = (jnp.sum(log_ratio_BT * mask_BT, axis=-1)
                   / jnp.maximum(jnp.sum(mask_BT, axis=-1), 1.0))
    log_ratio_BT = jnp.broadcast_to(log_ratio_B[:, None], log_ratio_BT.shape)
  log_ratio_BT = jnp.clip(log_ratio_BT, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
  ratio_BT = jnp.exp(log_ratio_BT)
  unclipped_BT = -adv_BT * ratio_BT
  clipped_BT = -adv_BT * jnp.clip(ratio_BT, 1.0 - epsilon_low, 1.0 + epsilon_high)
  pg_BT = jnp.maximum(unclipped_BT, clipped_BT)
  if dual_clip is not None:
    pg_BT = jnp.where(adv_BT < 0, jnp.minimum(pg_BT, -adv_BT * dual_clip), pg_BT)
  loss_BT = pg_BT
  kl_BT = None
  if ref_logprobs is not None:
    kl_BT = kl_penalty(logprobs, jax.lax.stop_gradient(ref_logprobs.astype(jnp.float32)),
                       kl_estimator)
    if beta:
      loss_BT = pg_BT + beta * kl_BT
  totals = totals or batch_totals(mask_BT)
  loss = aggregate(loss_BT, mask_BT, aggregation, max_response_len, totals)

  sg = jax.lax.stop_gradient
  token_mean = lambda x_BT: aggregate(sg(x_BT).astype(jnp.float32), mask_BT, "token-mean",
                                      totals=totals)
  ratio = sg(ratio_BT)
  on = mask_BT > 0
  metrics = {
      "clip_frac_low": token_mean((adv_BT < 0) & (ratio < 1.0 - epsilon_low)),
      "clip_frac_high": token_mean((adv_BT > 0) & (ratio > 1.0 + epsilon_high)),
      "ratio_mean": token_mean(ratio),
      "ratio_min": jnp.min(jnp.where(on, ratio, jnp.inf)),
      "ratio_max": jnp.max(jnp.where(on, ratio, -jnp.inf)),
      "pg_loss": sg(aggregate(pg_BT, mask_BT, aggregation, max_response_len, totals)),
  }
  if dual_clip is not None:
    metrics["dual_clip_frac"] = token_mean((adv_BT < 0) & (ratio > dual_clip))
  if kl_BT is not None:
    metrics["kl"] = token_mean(kl_BT)
  return loss, metrics


# one program per (rollout shape, estimator), not a dozen one-op programs dispatched eagerly
@functools.partial(jax.jit, static_argnames=("group_size", "estimator", "eps"))
def group_advantages(rewards_B: jax.Array, group_size: int, estimator: str = "grpo",
                     eps: float = 1e-4) -> jax.Array:
  """Advantages [B] of rewards [B] whose rows come in groups of `group_size` consecutive
  completions of one prompt:
    grpo    (r − mean_g) / (std_g + eps), std with Bessel's correction; a group whose std is below
            ZERO_STD (all rewards equal, e.g. both of a group of 2) gets 0, never NaN or a huge
            value from rounding
    drgrpo  r − mean_g (Dr. GRPO: no division by the std)
    rloo    r − mean of the group's other rewards = G / (G − 1) · (r − mean_g)"""
  if group_size < 2:
    raise ValueError(f"group_size={group_size}: advantages relative to a group need at least 2 "
                     "completions per prompt")
  r_GN = jnp.asarray(rewards_B, jnp.float32).reshape(-1, group_size)
  centred_GN = r_GN - jnp.mean(r_GN, axis=-1, keepdims=True)
  if estimator == "drgrpo":
    adv_GN = centred_GN
  elif estimator == "rloo":
    adv_GN = centred_GN * (group_size / (group_size - 1))
  elif estimator == "grpo":
    std_G1 = jnp.sqrt(jnp.sum(jnp.square(centred_GN), axis=-1, keepdims=True) / (group_size - 1))
    adv_GN = jnp.where(std_G1 < ZERO_STD, 0.0, centred_GN / (std_G1 + eps))
  else:
    raise ValueError(f"advantage_estimator={estimator!r}: one of {ADVANTAGE_ESTIMATORS}")
  return adv_GN.reshape(-1)


def informative_rows(rewards_B, group_size: int) -> np.ndarray:
  """[B] bool: the rows of the groups whose rewards are not all equal (std >= ZERO_STD). DAPO's
  dynamic sampling keeps only these: a group of equal rewards has advantage 0 everywhere and would
  only dilute a token- or row-mean of the loss."""
  r_GN = np.asarray(rewards_B, np.float64).reshape(-1, group_size)
  return np.repeat(r_GN.std(axis=1) >= ZERO_STD, group_size)


def overlong_penalty(lengths_B, max_len: int, buffer: int) -> np.ndarray:
  """DAPO's soft overlong punishment, added to the reward: 0 for a completion of at most
  max_len − buffer tokens, then falling linearly to −1 at max_len tokens (and −1 beyond)."""
  over = np.asarray(lengths_B, np.float64) - (max_len - buffer)
  return -np.clip(over / buffer, 0.0, 1.0)
