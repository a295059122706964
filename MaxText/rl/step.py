"""GRPO's compiled programs on the training mesh: the token log-probabilities of a rollout batch
(the policy's, or the reference's), and the optimizer step on the clipped policy loss
(MaxText/rl/losses.py). The log-probabilities come from the model's final hidden state and its head
applied chunk by chunk (`losses/loss.py: chunked_target_log_probs`, `loss_chunk_length`), so the
fp32 [B, S, V] logits never exist whole when the chunk is set; under a mesh split only over the
batch, with at most V tokens in the batch, the head runs split over the vocabulary as in the
training loss (each device a vocabulary slice of the head, the whole head never gathered; a
LoRA'd head too, its adapters folded into one projection first: MaxText/losses/lora_head.py).

A rollout batch is [N, S] arrays (N = prompts x completions per prompt, S = max_target_length):
  inputs, targets, positions, segments   the prompt + completion, shifted by one (segments 1 on
                                         real tokens, 0 on padding)
  mask                                   1 on the targets that are completion tokens
  old_logprobs, ref_logprobs             [N, S] fp32 (ref: zeros when unused)
  advantages                             [N]
The reference with LoRA is the same parameters with the adapters zeroed: x W + s (x A) 0 = x W,
the base exactly, without a second copy of the weights.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from MaxText.layers import lora
from MaxText.losses.lora_head import head_for_log_probs
from MaxText.losses.loss import chunked_target_log_probs
from MaxText.models.model_def import ModelDef
from MaxText.rl.losses import aggregate, policy_loss
from MaxText.sharding.rules import Rules, logical_to_spec, use_rules
from MaxText.train.step import applied_learning_rate, guarded_update

TOKEN_KEYS = ("inputs", "targets", "positions", "segments")
FLOAT_KEYS = ("mask", "old_logprobs", "ref_logprobs")
ROW_AXES = ("activation_batch", "activation_length")


def batch_shardings(mesh: Mesh, rules: Rules, rows: int, seq: int) -> dict[str, NamedSharding]:
  spec = logical_to_spec(ROW_AXES, (rows, seq), rules, mesh)
  out = {k: NamedSharding(mesh, spec) for k in (*TOKEN_KEYS, *FLOAT_KEYS)}
  out["advantages"] = NamedSharding(mesh, PartitionSpec(spec[0]))
  return out


def base_only(params):
  """The parameters with every LoRA adapter zeroed: what the base computes (module docstring)."""
  adapters, base = lora.split(params)
  return lora.join(jax.tree.map(jnp.zeros_like, adapters), base)


def token_logprobs(model_def: ModelDef, params, batch: dict, chunk: int, entropy: bool = False):
  """log p(target) [N, S] (and, with `entropy`, the entropy per position)."""
  hidden, _ = model_def.apply_hidden(params, batch["inputs"], batch["positions"],
                                     batch["segments"])
  head, head_params, axes, hidden = head_for_log_probs(model_def, params, hidden, chunk)
  return chunked_target_log_probs(head, head_params, hidden, batch["targets"], chunk, entropy,
                                  axes)


def make_logprob_fn(model_def: ModelDef, mesh: Mesh, rules: Rules, chunk: int,
                    shardings: dict[str, NamedSharding], reference_base: bool) -> Callable:
  """jitted (params, batch) → log p [N, S] of the policy, or with `reference_base` of the base
  under its LoRA adapters."""
  def fn(params, batch):
    with use_rules(mesh, rules):
      return token_logprobs(model_def, base_only(params) if reference_base else params, batch,
                            chunk)
  jitted = jax.jit(fn, in_shardings=(None, {k: shardings[k] for k in TOKEN_KEYS}),
                   out_shardings=shardings["mask"])
  return lambda params, batch: jitted(params, {k: batch[k] for k in TOKEN_KEYS})


def make_grpo_step(model_def: ModelDef, tx: optax.GradientTransformation, *, mesh: Mesh,
                   rules: Rules, lr_schedule: optax.Schedule, chunk: int, adapters_only: bool,
                   use_reference: bool, loss_kwargs: dict) -> Callable:
  """(state, batch) → (state with one optimizer update, metrics). `state["step"]` is left to the
  loop (it counts rollout batches); non-finite updates are never applied (train/step.py)."""
  split, join = (lora.split, lora.join) if adapters_only else ((lambda p: (p, {})),
                                                               (lambda t, _: t))

  def loss_fn(trained, frozen, batch):
    logp, ent = token_logprobs(model_def, join(trained, frozen), batch, chunk, entropy=True)
    loss, metrics = policy_loss(logp, batch["old_logprobs"],
                                batch["ref_logprobs"] if use_reference else None,
                                batch["advantages"], batch["mask"], **loss_kwargs)
    metrics["entropy"] = aggregate(jax.lax.stop_gradient(ent), batch["mask"], "token-mean")
    return loss, metrics

  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def step(state, batch):
    with use_rules(mesh, rules):
      params, frozen = split(state["params"])
      (loss, metrics), grads = grad_fn(params, frozen, batch)
      new_params, opt_state, grad_norm, finite = guarded_update(tx, grads, state["opt_state"],
                                                                params, loss)
      metrics.update(loss=loss, grad_norm=grad_norm, finite=finite.astype(jnp.float32),
                     lr=applied_learning_rate(state["opt_state"], lr_schedule))
    return {"step": state["step"], "params": join(new_params, frozen),
            "opt_state": opt_state}, metrics
  return step


def jit_grpo_step(step_fn: Callable, state_shardings, shardings: dict[str, NamedSharding],
                  mesh: Mesh) -> Callable:
  replicated = NamedSharding(mesh, PartitionSpec())
  return jax.jit(step_fn, in_shardings=(state_shardings, shardings),
                 out_shardings=(state_shardings, replicated), donate_argnums=(0,))
