"""The token log-probabilities of a batch of rows — what the preference (DPO) and policy-gradient
(GRPO) objectives score — from the model's final hidden state and its head applied chunk by chunk
(`losses/chunked.py: chunked_target_log_probs`, `loss_chunk_length`), so the fp32 [B, S, V] logits
never exist whole when the chunk is set; under a mesh split only over the batch, with at most V
tokens in the batch, the head runs split over the vocabulary as in the training loss (a LoRA'd
head too, its A applied to the hidden state first: losses/lora_head.py).

Rows are {"inputs", "targets" (the next token), "positions", "segments"}, all [B, S]. The model's
log-probabilities are aligned with the targets (position t: log p(targets[t]) = log
p(inputs[t + 1])); `aligned` moves them onto the tokens (position t: log p(inputs[t])).

The reference with LoRA is the same parameters with the adapters zeroed (`base_only`): x W + s
(x A) 0 = x W, the base exactly, without a second copy of the weights.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from MaxText.layers import lora
from MaxText.losses.chunked import chunked_target_log_probs
from MaxText.losses.lora_head import head_for_log_probs
from MaxText.models.model_def import ModelDef


def base_only(params):
  """The parameters with every LoRA adapter zeroed: what the base computes (module docstring)."""
  adapters, base = lora.split(params)
  return lora.join(jax.tree.map(jnp.zeros_like, adapters), base)


def token_logprobs(model_def: ModelDef, params, batch: dict, chunk: int, entropy: bool = False):
  """log p(target) [N, S] (and, with `entropy`, the entropy per position)."""
  return logprobs_and_aux(model_def, params, batch, chunk, entropy)[0]


def logprobs_and_aux(model_def: ModelDef, params, batch: dict, chunk: int, entropy: bool
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
