"""Preference-optimization losses on pairs (chosen, rejected) of responses to one prompt, from the
sequence log-probabilities of the responses' tokens: DPO and its variants against a reference
(`sigmoid`, `ipo`, `hinge`, `robust`) and the reference-free `orpo` and `simpo` — the formulas of
TRL 1.16 (DPOTrainer's loss types, ORPOTrainer's odds-ratio loss, CPOTrainer's `simpo`), which
tests/test_dpo_losses.py runs as the oracle.

Per pair, with s = the summed log-probability of a response's tokens, n its token count and
Δ = (s_c - ref_c) - (s_r - ref_r):
  sigmoid   -log σ(βΔ)
  hinge     max(0, 1 - βΔ)
  ipo       ((s_c - ref_c) / n_c - (s_r - ref_r) / n_r - 1 / 2β)²      (length-normalised, as TRL)
  robust    (-(1 - ε) log σ(βΔ) + ε log σ(-βΔ)) / (1 - 2ε)             (ε = label_smoothing)
  simpo     -(1 - ε) log σ(β(a_c - a_r) - γ) - ε log σ(-(β(a_c - a_r) - γ)),  a = s / n
  orpo      -β log σ(log odds(a_c) - log odds(a_r)),  odds(a) = e^a / (1 - e^a); plus the mean
            cross-entropy of the chosen rows' tokens (prompt and response, as TRL's ORPO)
The loss is the mean over pairs (+ ORPO's cross-entropy). The rewards logged: β (s - ref) for DPO,
β a for the reference-free ones; `logps/*` are s (DPO) or a (ORPO, SimPO), as TRL logs them.

Every function takes and returns sums over pairs (`pair_sums`), so gradient accumulation over
micro-batches of pairs adds up to the whole batch's value exactly.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

DPO_LOSSES = ("sigmoid", "ipo", "hinge", "robust")
REFERENCE_FREE = ("orpo", "simpo")
LOSSES = (*DPO_LOSSES, *REFERENCE_FREE)
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
           "logps/chosen", "logps/rejected")


def uses_reference(loss: str) -> bool:
  return loss in DPO_LOSSES


def log1mexp(x: jax.Array) -> jax.Array:
  """log(1 - e^x) for x < 0, branching at -ln 2 (no cancellation on either side)."""
  t = -math.log(2.0)
  return jnp.where(x < t, jnp.log1p(-jnp.exp(jnp.minimum(x, t))),
                   jnp.log(-jnp.expm1(jnp.maximum(x, t))))


def per_pair(logps_c: jax.Array, logps_r: jax.Array, n_c: jax.Array, n_r: jax.Array,
             ref_c: jax.Array | None, ref_r: jax.Array | None, *, loss: str, beta: float,
             label_smoothing: float = 0.0, simpo_gamma: float = 0.0
             ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """(per-pair loss [P], per-pair metrics [P]) from the summed response log-probabilities `logps_*`
  [P], the response token counts `n_*` [P] and the reference's sums `ref_*` (DPO losses only)."""
  sg = jax.lax.stop_gradient
  ls = label_smoothing
  if loss in DPO_LOSSES:
    if ref_c is None or ref_r is None:
      raise ValueError(f"dpo_loss={loss} needs the reference's log-probabilities")
    lr_c, lr_r = logps_c - ref_c, logps_r - ref_r
    delta = lr_c - lr_r
    if loss == "sigmoid":
      out = -jax.nn.log_sigmoid(beta * delta)
    elif loss == "hinge":
      out = jax.nn.relu(1.0 - beta * delta)
    elif loss == "ipo":
      out = (lr_c / jnp.maximum(n_c, 1.0) - lr_r / jnp.maximum(n_r, 1.0) - 1.0 / (2 * beta)) ** 2
    else:   # robust
      out = (-(1 - ls) * jax.nn.log_sigmoid(beta * delta)
             + ls * jax.nn.log_sigmoid(-beta * delta)) / (1 - 2 * ls)
    reward_c, reward_r = beta * sg(lr_c), beta * sg(lr_r)
    shown_c, shown_r = logps_c, logps_r
  else:
    a_c, a_r = logps_c / n_c, logps_r / n_r
    if loss == "simpo":
      z = beta * (a_c - a_r - simpo_gamma / beta)
      out = -jax.nn.log_sigmoid(z) * (1 - ls) - jax.nn.log_sigmoid(-z) * ls
    elif loss == "orpo":
      log_odds = (a_c - a_r) - (log1mexp(a_c) - log1mexp(a_r))
      out = -beta * jax.nn.log_sigmoid(log_odds)
    else:
      raise ValueError(f"unknown preference loss {loss!r}; one of {', '.join(LOSSES)}")
    reward_c, reward_r = beta * sg(a_c), beta * sg(a_r)
    shown_c, shown_r = a_c, a_r
  metrics = {"rewards/chosen": reward_c, "rewards/rejected": reward_r,
             "rewards/margins": reward_c - reward_r,
             "rewards/accuracies": (reward_c > reward_r).astype(jnp.float32),
             "logps/chosen": sg(shown_c), "logps/rejected": sg(shown_r)}
  return out, metrics


def pair_sums(logps_c, logps_r, n_c, n_r, ref_c, ref_r, weight, **kw
              ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """(Σ weight x per-pair loss, {metric: Σ weight x metric}) over the pairs; `weight` [P] is 1 on
  real pairs, 0 on padding. Divide by the number of pairs for the means."""
  out, metrics = per_pair(logps_c, logps_r, n_c, n_r, ref_c, ref_r, **kw)
  return jnp.sum(weight * out), {k: jnp.sum(weight * v) for k, v in metrics.items()}
