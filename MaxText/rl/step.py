"""The policy's compiled programs on the training mesh (MaxText/rl/policy.py): the token
log-probabilities of a batch (the policy's, or the reference's) and the optimizer update on a
policy loss, with gradient accumulation over micro-batches and the family's changes outside the
gradient. The log-probabilities come from the model's final hidden state and its head applied
chunk by chunk (`losses/chunked.py: chunked_target_log_probs`, `loss_chunk_length`), so the fp32
[B, S, V] logits never exist whole when the chunk is set; under a mesh split only over the batch,
with at most V tokens in the batch, the head runs split over the vocabulary as in the training
loss (a LoRA'd head too, its A applied to the hidden state first: losses/lora_head.py).

The arrays (`rl/batch.py: model_arrays`, all [B, S]): inputs, targets (the next token), positions,
segments, mask (the scored tokens, aligned with `inputs`), weight (the row's sample weight),
old_logprobs, reference_logprobs, advantages. Log-probabilities handed in and out are aligned with
the tokens (position t: log p(inputs[t])), the model's with the targets (position t: log
p(targets[t]) = log p(inputs[t + 1])); `aligned` moves the second onto the first.

A loss is `fn(logprobs, batch) -> (loss, aux)` on one micro-batch (logprobs [b, S] aligned with
the tokens; `batch` the arrays above plus "batch_tokens" / "batch_rows": the whole batch's
weighted scored tokens and rows with any). The update sums the micro-batches' losses and
gradients, so a loss normalised by those totals (as GRPO's is, `grpo_loss`) gives one pass's
update; aux values are summed too, except keys ending in `_min` / `_max` (their min / max).

The reference with LoRA is the same parameters with the adapters zeroed: x W + s (x A) 0 = x W,
the base exactly, without a second copy of the weights.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from MaxText.layers import lora
from MaxText.losses.chunked import chunked_target_log_probs
from MaxText.losses.lora_head import head_for_log_probs
from MaxText.models.family import AuxTerms
from MaxText.models.model_def import ModelDef
from MaxText.rl.losses import aggregate, batch_totals, policy_loss
from MaxText.sharding.rules import BATCH_AXES, Rules, constrain, logical_to_spec, use_rules
from MaxText.train.optimizer import Optimizer
from MaxText.train.step import applied_learning_rate, guarded_update, keep_if, moment_shardings

TOKEN_KEYS = ("inputs", "targets", "positions", "segments")
FLOAT_KEYS = ("mask", "old_logprobs", "reference_logprobs", "advantages")
ROW_AXES = ("activation_batch", "activation_length")
LossFn = Callable[[jax.Array, dict], tuple[jax.Array, dict]]


def batch_shardings(mesh: Mesh, rules: Rules, rows: int, seq: int) -> dict[str, NamedSharding]:
  spec = logical_to_spec(ROW_AXES, (rows, seq), rules, mesh)
  out = {k: NamedSharding(mesh, spec) for k in (*TOKEN_KEYS, *FLOAT_KEYS)}
  out["weight"] = NamedSharding(mesh, PartitionSpec(spec[0]))
  return out


def base_only(params):
  """The parameters with every LoRA adapter zeroed: what the base computes (module docstring)."""
  adapters, base = lora.split(params)
  return lora.join(jax.tree.map(jnp.zeros_like, adapters), base)


def token_logprobs(model_def: ModelDef, params, batch: dict, chunk: int, entropy: bool = False):
  """log p(target) [N, S] (and, with `entropy`, the entropy per position)."""
  return _logprobs(model_def, params, batch, chunk, entropy)[0]


def _logprobs(model_def: ModelDef, params, batch: dict, chunk: int, entropy: bool
              ) -> tuple[Any, Any]:
  """(log p(target) [N, S], or with `entropy` (it, the entropy per position); the model's
  auxiliary outputs)."""
  hidden, aux = model_def.apply_hidden(params, batch["inputs"], batch["positions"],
                                       batch["segments"])
  head, head_params, axes, hidden = head_for_log_probs(model_def, params, hidden, chunk)
  return chunked_target_log_probs(head, head_params, hidden, batch["targets"], chunk, entropy,
                                  axes), aux


def aligned(x_BS: jax.Array) -> jax.Array:
  """Target-aligned values → token-aligned ones (position 0: 0)."""
  return jnp.concatenate([jnp.zeros_like(x_BS[:, :1]), x_BS[:, :-1]], axis=1)


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


def grpo_loss(loss_kwargs: dict, use_reference: bool) -> LossFn:
  """The clipped policy loss (rl/losses.py: policy_loss, `loss_kwargs` its settings) as a loss on
  micro-batches of a whole batch (module docstring)."""
  def fn(logprobs, batch):
    totals = {"tokens": batch["batch_tokens"], "rows": batch["batch_rows"]}
    weights = batch["mask"] * batch["weight"][:, None]
    return policy_loss(logprobs, batch["old_logprobs"],
                       batch["reference_logprobs"] if use_reference else None,
                       batch["advantages"], weights, totals=totals, **loss_kwargs)
  return fn


def _combine(a: dict, b: dict) -> dict:
  return {k: (jnp.minimum if k.endswith("_min") else jnp.maximum if k.endswith("_max")
              else jnp.add)(a[k], b[k]) for k in a}


def make_update(model_def: ModelDef, tx: Optimizer, *, mesh: Mesh, rules: Rules,
                lr_schedule: Any, chunk: int, adapters_only: bool, loss_fn: LossFn,
                micro_batches: int, aux_terms: AuxTerms | None) -> Callable:
  """(state, arrays) → (state after one optimizer update, metrics). The batch is split into
  `micro_batches` (rows j, j + A, j + 2A, …: each device's rows hold an equal share of every
  micro-batch, so no rows move) whose gradients are summed inside the one program. The family's
  changes outside the gradient (`aux_terms.update`, e.g. the router bias) follow the update, from
  the statistics of every micro-batch's forward pass; its auxiliary loss is not added.
  `state["step"]` is left to the caller; a non-finite update is never applied (train/step.py)."""
  split, join = (lora.split, lora.join) if adapters_only else ((lambda p: (p, {})),
                                                               (lambda t, _: t))

  def micro_loss(trained, frozen, micro):
    (logp, ent), aux = _logprobs(model_def, join(trained, frozen), micro, chunk, entropy=True)
    loss, metrics = loss_fn(aligned(logp), micro)
    weights = micro["mask"] * micro["weight"][:, None]
    metrics = dict(metrics)
    metrics["entropy"] = aggregate(jax.lax.stop_gradient(aligned(ent)), weights, "token-mean",
                                   totals={"tokens": micro["batch_tokens"]})
    sums = aux_terms.loss(aux)[1] if aux_terms is not None else {}
    return loss, (metrics, sums, jnp.sum(micro["segments"] != 0).astype(jnp.float32))

  grad_fn = model_def.at_precision(jax.value_and_grad(micro_loss, has_aux=True))

  def update(state, batch, shardings=None):
    zero_shardings = None   # ZeRO-1 (train/step.py): the moments' shardings, the trained params'
    if shardings is not None and tx.shard_over_data:
      zero_shardings = (moment_shardings(shardings["opt_state"]), split(shardings["params"])[0])
    with use_rules(mesh, rules):
      params, frozen = split(state["params"])
      totals = batch_totals(batch["mask"] * batch["weight"][:, None])
      batch = {**batch, "batch_tokens": totals["tokens"], "batch_rows": totals["rows"]}
      if micro_batches == 1:
        (loss, (metrics, sums, tokens)), grads = grad_fn(params, frozen, batch)
      else:
        A = micro_batches
        scalars = {k: v for k, v in batch.items() if not v.ndim}
        rows = jax.tree.map(lambda x: x.reshape(x.shape[0] // A, A, *x.shape[1:]).swapaxes(0, 1),
                            {k: v for k, v in batch.items() if v.ndim})

        def one(micro):
          micro = {**jax.tree.map(lambda x: constrain(x, BATCH_AXES[:x.ndim]), micro), **scalars}
          return grad_fn(params, frozen, micro)

        first = jax.tree.map(lambda x: x[0], rows)
        (loss, (metrics, sums, tokens)), grads = one(first)

        def accumulate(carry, micro):
          (l, (m, s, n)), g = one(micro)
          acc_l, acc_m, acc_s, acc_n, acc_g = carry
          return (acc_l + l, _combine(acc_m, m), jax.tree.map(jnp.add, acc_s, s), acc_n + n,
                  jax.tree.map(jnp.add, acc_g, g)), None

        rest = jax.tree.map(lambda x: x[1:], rows)
        (loss, metrics, sums, tokens, grads), _ = jax.lax.scan(
            accumulate, (loss, metrics, sums, tokens, grads), rest)
      new_params, opt_state, grad_norm, finite = guarded_update(tx, grads, state["opt_state"],
                                                                params, loss, zero_shardings)
      new_params = join(new_params, frozen)
      if aux_terms is not None and not adapters_only:
        new_params = keep_if(finite, aux_terms.update(new_params, sums), new_params)
      metrics = {**metrics, "loss": loss, "grad_norm": grad_norm,
                 "finite": finite.astype(jnp.float32),
                 "lr": applied_learning_rate(state["opt_state"], lr_schedule)}
      if aux_terms is not None:
        metrics.update(aux_terms.metrics(sums, jnp.maximum(tokens, 1.0)))
    return {**state, "params": new_params, "opt_state": opt_state}, metrics
  return update


def jit_update(update: Callable, state_shardings, shardings: dict[str, NamedSharding],
               mesh: Mesh) -> Callable:
  replicated = NamedSharding(mesh, PartitionSpec())
  update = functools.partial(update, shardings=state_shardings)   # ZeRO-1's shardings
  return jax.jit(update, in_shardings=(state_shardings, shardings),
                 out_shardings=(state_shardings, replicated), donate_argnums=(0,))
