"""DPO's compiled programs on the training mesh: the summed response log-probabilities of a batch
of pairs (the policy's, or the reference's: with LoRA the base under the adapters, no copy —
MaxText/rl/step.py: `base_only`), and the optimizer step on the preference loss
(MaxText/losses/preference.py), with gradient accumulation over micro-batches of pairs.

A batch of P pairs: {"chosen": rows, "rejected": rows, "ref": {"chosen": [P], "rejected": [P]}},
rows being [P, S] inputs, targets, positions, segments (int32) and mask, real (fp32; data.py). One
forward runs the 2P rows (chosen then rejected) together; the head and the log-probabilities go
chunk by chunk (`loss_chunk_length`) as in GRPO. Packed pairs (`preference_packing`): the token
arrays under "packed" ([P, S], both sequences of a pair in one row, segment ids apart) and per side
only mask and real over that row: one forward of P rows, each side's sums through its own mask.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from MaxText.layers import lora
from MaxText.losses.preference import pair_sums
from MaxText.models.model_def import ModelDef
from MaxText.rl.step import base_only, token_logprobs
from MaxText.sharding.rules import BATCH_AXES, Rules, constrain, logical_to_spec, use_rules
from MaxText.train.step import applied_learning_rate, guarded_update, moment_shardings

TOKEN_KEYS = ("inputs", "targets", "positions", "segments")
SIDES = ("chosen", "rejected")
ROW_AXES = ("activation_batch", "activation_length")


def batch_shardings(mesh: Mesh, rules: Rules, pairs: int, seq: int, packed: bool = False
                    ) -> dict:
  """The shardings of a batch of `pairs` (the tree of the module docstring)."""
  spec = logical_to_spec(ROW_AXES, (pairs, seq), rules, mesh)
  row = NamedSharding(mesh, spec)
  per_pair = NamedSharding(mesh, PartitionSpec(spec[0]))
  side_keys = ("mask", "real") if packed else (*TOKEN_KEYS, "mask", "real")
  out = {s: {k: row for k in side_keys} for s in SIDES}
  if packed:
    out["packed"] = {k: row for k in TOKEN_KEYS}
  return {**out, "ref": {s: per_pair for s in SIDES}}


def row_parts(tree: dict) -> dict:
  """The parts of a batch (or of its shardings) that hold rows: the sides (and "packed")."""
  return {k: v for k, v in tree.items() if k != "ref"}


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


def make_sums_fn(model_def: ModelDef, mesh: Mesh, rules: Rules, chunk: int, shardings: dict,
                 reference_base: bool) -> Callable:
  """jitted (params, batch) → {"chosen": [P], "rejected": [P]} summed response log-probabilities of
  the policy, or with `reference_base` of the base under its LoRA adapters."""
  def fn(params, sides):
    with use_rules(mesh, rules):
      lc, lr = side_logps(model_def, base_only(params) if reference_base else params, sides,
                          chunk)
      return {"chosen": (lc * sides["chosen"]["mask"]).sum(-1),
              "rejected": (lr * sides["rejected"]["mask"]).sum(-1)}
  jitted = jax.jit(fn, in_shardings=(None, row_parts(shardings)), out_shardings=shardings["ref"])
  return lambda params, batch: jitted(params, row_parts(batch))


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


def make_dpo_step(model_def: ModelDef, tx, *, mesh: Mesh, rules: Rules,
                  lr_schedule: optax.Schedule, chunk: int, adapters_only: bool, grad_accum: int,
                  loss_kwargs: dict) -> Callable:
  """(state, batch) → (state after one optimizer update, metrics: the loss, the means over the
  pairs of preference.METRICS, nll_loss with orpo). Non-finite updates are never applied."""
  split, join = (lora.split, lora.join) if adapters_only else ((lambda p: (p, {})),
                                                               (lambda t, _: t))

  def micro_loss(trained, frozen, micro, pairs, nll_tokens):
    return batch_loss(model_def, join(trained, frozen), micro, chunk=chunk,
                      loss_kwargs=loss_kwargs, pairs=pairs, nll_tokens=nll_tokens)

  grad_fn = model_def.at_precision(jax.value_and_grad(micro_loss, has_aux=True))

  def step(state, batch, shardings=None):
    zero_shardings = None   # ZeRO-1 (train/step.py): the moments' shardings, the trained params'
    if shardings is not None and tx.shard_over_data:
      zero_shardings = (moment_shardings(shardings["opt_state"]), split(shardings["params"])[0])
    with use_rules(mesh, rules):
      params, frozen = split(state["params"])
      pairs = jnp.asarray(batch["chosen"]["mask"].shape[0], jnp.float32)
      nll_tokens = jnp.maximum(batch["chosen"]["real"].sum(), 1.0)
      if grad_accum == 1:
        (loss, sums), grads = grad_fn(params, frozen, batch, pairs, nll_tokens)
      else:
        # micro-batch j = pairs j, j+A, j+2A, …: each device's block holds a share of each one
        micro_batches = jax.tree.map(
            lambda x: x.reshape(x.shape[0] // grad_accum, grad_accum, *x.shape[1:]).swapaxes(0, 1),
            batch)

        def accumulate(carry, micro):
          micro = jax.tree.map(lambda x: constrain(x, BATCH_AXES[:1] if x.ndim == 1
                                                   else BATCH_AXES), micro)
          (l, m), g = grad_fn(params, frozen, micro, pairs, nll_tokens)
          acc_g, acc_l, acc_m = carry
          return (jax.tree.map(jnp.add, acc_g, g), acc_l + l, jax.tree.map(jnp.add, acc_m, m)), None

        first = jax.tree.map(lambda x: x[0], micro_batches)
        shapes = jax.eval_shape(grad_fn, params, frozen, first, pairs, nll_tokens)[0][1]
        zero = (jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.float32),
                jax.tree.map(jnp.zeros_like, shapes))
        (grads, loss, sums), _ = jax.lax.scan(accumulate, zero, micro_batches)
      new_params, opt_state, grad_norm, finite = guarded_update(tx, grads, state["opt_state"],
                                                                params, loss, zero_shardings)
      metrics = {k: v / pairs for k, v in sums.items()}
      metrics.update(loss=loss, grad_norm=grad_norm, finite=finite.astype(jnp.float32),
                     lr=applied_learning_rate(state["opt_state"], lr_schedule))
    return {"step": state["step"] + 1, "params": join(new_params, frozen),
            "opt_state": opt_state}, metrics
  return step


def jit_dpo_step(step_fn: Callable, state_shardings, shardings: dict, mesh: Mesh) -> Callable:
  replicated = NamedSharding(mesh, PartitionSpec())
  step_fn = functools.partial(step_fn, shardings=state_shardings)   # ZeRO-1's shardings
  return jax.jit(step_fn, in_shardings=(state_shardings, shardings),
                 out_shardings=(state_shardings, replicated), donate_argnums=(0,))
