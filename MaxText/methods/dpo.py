"""DPO and its variants (python -m MaxText.dpo; MaxText/losses/preference.py: the losses, ORPO's
odds ratio with the chosen rows' cross-entropy): the summed response log-probabilities of a batch
of pairs against the reference's, one loss per pair.

A batch of P pairs: {"chosen": rows, "rejected": rows, "ref": {"chosen": [P], "rejected": [P]}},
rows being [P, S] inputs, targets, positions, segments (int32) and mask, real (fp32;
MaxText/dpo/data.py). One forward runs the 2P rows (chosen then rejected) together; the head and
the log-probabilities go chunk by chunk (`loss_chunk_length`, losses/logprobs.py). Packed pairs
(`preference_packing`): the token arrays under "packed" ([P, S], both sequences of a pair in one
row, segment ids apart) and per side only mask and real over that row: one forward of P rows, each
side's sums through its own mask.

Each micro-batch's loss is its pairs' losses / the step's pairs (`totals`: "pairs", and with ORPO
"nll_tokens", the step's chosen tokens), so the micro-batches add up to the step's loss exactly.
Metrics: loss, the means over the pairs of preference.METRICS, nll_loss with ORPO. The family's
terms are not used (the model's auxiliary outputs are not read: no auxiliary loss; the router-bias
update is refused, MaxText/dpo/trainer.py).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from MaxText.losses.logprobs import token_logprobs
from MaxText.losses.preference import pair_sums
from MaxText.methods.objective import Micro, Objective
from MaxText.methods.registry import Method
from MaxText.models.model_def import ModelDef

TOKEN_KEYS = ("inputs", "targets", "positions", "segments")


def side_logps(model_def: ModelDef, params, batch: dict, chunk: int
               ) -> tuple[jax.Array, jax.Array]:
  """(chosen's token log-probabilities [P, S], rejected's [P, S]) in one forward (packed: the
  same [P, S] for both, each side's own positions picked by its mask)."""
  if "packed" in batch:
    logp = token_logprobs(model_def, params, batch["packed"], chunk)
    assert isinstance(logp, jax.Array)
    return logp, logp
  rows = {k: jnp.concatenate([batch["chosen"][k], batch["rejected"][k]]) for k in TOKEN_KEYS}
  logp = token_logprobs(model_def, params, rows, chunk)
  assert isinstance(logp, jax.Array)   # no entropy asked for
  pairs = batch["chosen"]["inputs"].shape[0]
  return logp[:pairs], logp[pairs:]


def batch_loss(model_def: ModelDef, params, batch: dict, *, chunk: int, loss_kwargs: dict,
               pairs, nll_tokens) -> tuple[jax.Array, dict[str, jax.Array]]:
  """(this batch's share of the loss, its metric sums) with `params`: the per-pair losses summed
  over the batch's pairs / `pairs` (the step's pairs), plus with orpo the chosen rows' summed
  cross-entropy / `nll_tokens` (the step's chosen tokens) — so micro-batches add up to the step's
  loss exactly."""
  lc, lr = side_logps(model_def, params, batch, chunk)
  c, r = batch["chosen"], batch["rejected"]
  total, metrics = pair_sums((lc * c["mask"]).sum(-1), (lr * r["mask"]).sum(-1),
                             c["mask"].sum(-1), r["mask"].sum(-1), batch["ref"]["chosen"],
                             batch["ref"]["rejected"], jnp.ones_like(c["mask"][:, 0]),
                             **loss_kwargs)
  loss = total / pairs
  if loss_kwargs["loss"] == "orpo":
    nll = -(lc * c["real"]).sum() / nll_tokens
    loss = loss + nll
    metrics["nll_loss"] = jax.lax.stop_gradient(nll) * pairs   # the step divides by pairs
  return loss, metrics


@dataclasses.dataclass(frozen=True)
class Preference(Objective):
  loss_kwargs: dict       # preference.pair_sums' settings: loss, beta, label_smoothing, ...
  chunk: int = 0          # loss_chunk_length

  def totals(self, batch):
    return {"pairs": jnp.asarray(batch["chosen"]["mask"].shape[0], jnp.float32),
            "nll_tokens": jnp.maximum(batch["chosen"]["real"].sum(), 1.0)}

  def loss(self, params, micro, model_def, side):
    del side
    loss, sums = batch_loss(model_def, params, micro, chunk=self.chunk,
                            loss_kwargs=self.loss_kwargs, pairs=micro["pairs"],
                            nll_tokens=micro["nll_tokens"])
    return Micro(loss, sums)

  def finish(self, loss, sums, tokens, totals):
    del tokens
    return None, {**{k: v / totals["pairs"] for k, v in sums.items()}, "loss": loss}


METHOD = Method("dpo", Preference, "python -m MaxText.dpo")
