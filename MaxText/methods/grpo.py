"""GRPO and the policy-gradient losses (MaxText/rl: the trainer, the policy's API): the token
log-probabilities of a batch of scored rows under the policy (losses/logprobs.py, chunk by chunk)
and a loss on them — GRPO's clipped policy loss (losses/policy.py: `policy_loss`), or a user's
`fn(logprobs, batch) -> (loss, aux)` (MaxText/rl/policy.py: `Policy.train`).

The arrays (`rl/batch.py: model_arrays`, all [B, S]): inputs, targets (the next token), positions,
segments, mask (the scored tokens, aligned with `inputs`), weight (the row's sample weight, [B]),
old_logprobs, reference_logprobs, advantages. A loss sees one micro-batch: logprobs [b, S] aligned
with the tokens, and the arrays plus "batch_tokens" / "batch_rows" (`totals`: the whole batch's
weighted scored tokens and rows with any). The micro-batches' losses and aux values are summed
(keys ending in `_min` / `_max`: their min / max), so a loss normalised by those totals (as GRPO's
is) gives one pass's update. The family's auxiliary loss is not added (the objective is a
per-batch mean, not a sum over tokens); its statistics drive the router-bias update and its
metrics, averaged over the batch's tokens.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from MaxText.losses.logprobs import aligned, logprobs_and_aux
from MaxText.losses.policy import aggregate, batch_totals, policy_loss
from MaxText.methods.objective import Micro, Objective
from MaxText.methods.registry import Method

LossFn = Callable[[jax.Array, dict], tuple[jax.Array, dict]]


def grpo_loss(loss_kwargs: dict, use_reference: bool) -> LossFn:
  """The clipped policy loss (losses/policy.py: policy_loss, `loss_kwargs` its settings) as a loss
  on micro-batches of a whole batch (module docstring)."""
  def fn(logprobs, batch):
    totals = {"tokens": batch["batch_tokens"], "rows": batch["batch_rows"]}
    weights = batch["mask"] * batch["weight"][:, None]
    return policy_loss(logprobs, batch["old_logprobs"],
                       batch["reference_logprobs"] if use_reference else None,
                       batch["advantages"], weights, totals=totals, **loss_kwargs)
  return fn


@dataclasses.dataclass(frozen=True)
class PolicyGradient(Objective):
  loss_fn: LossFn         # on one micro-batch (module docstring)
  chunk: int = 0          # loss_chunk_length

  adds_aux_loss = False

  def totals(self, batch):
    totals = batch_totals(batch["mask"] * batch["weight"][:, None])
    return {"batch_tokens": totals["tokens"], "batch_rows": totals["rows"]}

  def loss(self, params, micro, model_def, side):
    del side
    (logp, ent), aux = logprobs_and_aux(model_def, params, micro, self.chunk, entropy=True)
    loss, metrics = self.loss_fn(aligned(logp), micro)
    weights = micro["mask"] * micro["weight"][:, None]
    metrics = dict(metrics)
    metrics["entropy"] = aggregate(jax.lax.stop_gradient(aligned(ent)), weights, "token-mean",
                                   totals={"tokens": micro["batch_tokens"]})
    return Micro(loss, metrics, aux, jnp.sum(micro["segments"] != 0).astype(jnp.float32))

  def finish(self, loss, sums, tokens, totals):
    del tokens, totals
    return None, {**sums, "loss": loss}


METHOD = Method("grpo", PolicyGradient, "MaxText/rl: python -m MaxText.rl.grpo, rl.Policy")
