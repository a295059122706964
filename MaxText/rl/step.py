"""The policy's compiled programs on the training mesh (MaxText/rl/policy.py): the token
log-probabilities of a batch (the policy's, or the reference's: with LoRA the same parameters
with the adapters zeroed, losses/logprobs.py: `base_only`) and the optimizer update on a policy
loss — the GRPO objective (MaxText/methods/grpo.py: the batch's arrays, the loss's contract) on
the update builder (MaxText/train/update.py: micro-batches, ZeRO-1, the guarded update, the
family's changes outside the gradient).

Log-probabilities handed in and out are aligned with the tokens (position t: log p(inputs[t])),
the model's with the targets (position t: log p(targets[t]) = log p(inputs[t + 1])); `aligned`
moves the second onto the first.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from MaxText.losses.logprobs import aligned, base_only, token_logprobs
from MaxText.methods.grpo import LossFn, grpo_loss
from MaxText.methods.registry import objective
from MaxText.models.family import AuxTerms
from MaxText.models.model_def import ModelDef
from MaxText.sharding.rules import Rules, logical_to_spec, use_rules
from MaxText.train import update as builder
from MaxText.train.optimizer import Optimizer

__all__ = ["FLOAT_KEYS", "LossFn", "ROW_AXES", "TOKEN_KEYS", "aligned", "base_only",
           "batch_shardings", "grpo_loss", "jit_update", "make_logprob_fn", "make_update",
           "token_logprobs"]

TOKEN_KEYS = ("inputs", "targets", "positions", "segments")
FLOAT_KEYS = ("mask", "old_logprobs", "reference_logprobs", "advantages")
ROW_AXES = ("activation_batch", "activation_length")


def batch_shardings(mesh: Mesh, rules: Rules, rows: int, seq: int) -> dict[str, NamedSharding]:
  spec = logical_to_spec(ROW_AXES, (rows, seq), rules, mesh)
  out = {k: NamedSharding(mesh, spec) for k in (*TOKEN_KEYS, *FLOAT_KEYS)}
  out["weight"] = NamedSharding(mesh, PartitionSpec(spec[0]))
  return out


def make_logprob_fn(model_def: ModelDef, mesh: Mesh, rules: Rules, chunk: int,
                    shardings: dict[str, NamedSharding], reference_base: bool) -> Callable:
  """jitted (params, arrays) → token-aligned log p [N, S] (0 outside the mask) of the policy, or
  with `reference_base` of the base under its LoRA adapters."""
  def fn(params, batch):
    with use_rules(mesh, rules):
      lp = token_logprobs(model_def, base_only(params) if reference_base else params, batch,
                          chunk)
      return jnp.where(batch["mask"] > 0, aligned(lp), 0.0)
  keys = (*TOKEN_KEYS, "mask")
  jitted = jax.jit(fn, in_shardings=(None, {k: shardings[k] for k in keys}),
                   out_shardings=shardings["mask"])
  return lambda params, batch: jitted(params, {k: batch[k] for k in keys})


def make_update(model_def: ModelDef, tx: Optimizer, *, mesh: Mesh, rules: Rules,
                lr_schedule: Any, chunk: int, adapters_only: bool, loss_fn: LossFn,
                micro_batches: int, aux_terms: AuxTerms | None) -> Callable:
  """(state, arrays) → (state after one optimizer update, metrics: the loss's, entropy, loss,
  grad_norm, lr, finite, the family's). The batch is split into `micro_batches`; the family's
  changes outside the gradient (the router bias) follow the update. `state["step"]` is left to
  the caller (a GRPO step is several updates)."""
  return builder.make_update(objective("grpo", loss_fn=loss_fn, chunk=chunk), model_def, tx,
                             mesh=mesh, rules=rules, lr_schedule=lr_schedule,
                             grad_accum=micro_batches, aux_terms=aux_terms,
                             adapters_only=adapters_only, count_step=False)


def jit_update(update: Callable, state_shardings, shardings: dict[str, NamedSharding],
               mesh: Mesh) -> Callable:
  return builder.jit_update(update, state_shardings, shardings, mesh)
