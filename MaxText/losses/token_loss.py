"""The train step's token loss of a micro-batch (train/step.py, evaluation): masked cross-entropy
(+ z-loss) over the whole sequence's logits, or with `loss_chunk_length` the model's final hidden
state and its head chunk by chunk (`chunked.py`). A model that trains an MTP block
(`ModelDef.mtp_depths` > 0) also gives its depths' hidden states; their sums (`mtp.py`) go back
in the auxiliary outputs as aux["mtp_sums"]."""
from __future__ import annotations

import contextlib
from typing import Any

import jax

from MaxText.layers.context_parallel import balanced_layout, context_size, to_balanced
from MaxText.losses.chunked import chunked_cross_entropy_sums
from MaxText.losses.mtp import mtp_sums
from MaxText.losses.token_stats import cross_entropy_sums
from MaxText.data.batch import MEDIA_KEYS
from MaxText.models.model_def import ModelDef
from MaxText.sharding.rules import BATCH_AXES, constrain, current_context

TOKEN_KEYS = ("inputs", "inputs_position", "inputs_segmentation", "targets", "targets_segmentation")


def context_layout(model_def: ModelDef, micro: dict):
  """(the micro-batch, a context for the model's call): under a mesh that splits the sequence
  over the context axis and a model that runs it in the load-balanced order
  (`ModelDef.balance_context`), the token arrays in that order (positions and segment ids with
  their tokens; the masked token sums are unchanged) and `balanced_layout()`; else as they are.
  Rows with media keep the natural order (their soft tokens are placed in sequence order), and
  so do runs that train MTP depths (their targets are the sequence shifted)."""
  B, S = micro["inputs"].shape
  n = context_size(current_context(), B, S)
  if (n == 1 or not model_def.balance_context or S % (2 * n) or media_of(micro)
      or model_def.mtp_depths):
    return micro, contextlib.nullcontext()
  micro = {k: constrain(to_balanced(x, n), BATCH_AXES) if k in TOKEN_KEYS else x
           for k, x in micro.items()}
  return micro, balanced_layout()


def media_of(micro: dict) -> dict:
  """A batch's media slots ([B, N, ...] per row, data/media_rows.py) as the towers take them:
  every row's items in row order, [B·N, ...] (empty slots yield no soft token)."""
  return {k: v.reshape(-1, *v.shape[2:]) for k, v in micro.items() if k in MEDIA_KEYS}


def token_loss_sums(model_def: ModelDef, params, micro: dict, *, z_loss_weight: float,
                    chunk: int) -> tuple[jax.Array, jax.Array, jax.Array, dict]:
  """(loss sum, z-loss sum, token count, the model's auxiliary outputs) of one micro-batch."""
  micro, layout = context_layout(model_def, micro)
  with layout:
    return _sums(model_def, params, micro, z_loss_weight=z_loss_weight, chunk=chunk)


def _sums(model_def: ModelDef, params, micro: dict, *, z_loss_weight: float, chunk: int):
  args = (micro["inputs"], micro["inputs_position"], micro["inputs_segmentation"])
  mask_BS = micro["targets_segmentation"] != 0
  kwargs: dict[str, Any] = {"media": media} if (media := media_of(micro)) else {}
  if model_def.mtp_depths:
    kwargs["mtp"] = True
  if chunk <= 0:
    logits_BSV, aux = model_def.apply_with_aux(params, *args, **kwargs)
    sums = cross_entropy_sums(logits_BSV, micro["targets"], mask_BS, z_loss_weight)
  else:
    hidden_BSD, aux = model_def.apply_hidden(params, *args, **kwargs)
    sums = chunked_cross_entropy_sums(model_def.head, params, hidden_BSD, micro["targets"],
                                      mask_BS, z_loss_weight, chunk, model_def.logical_axes)
  if "mtp_hidden" in aux:
    aux = {**aux, "mtp_sums": mtp_sums(model_def, params, aux.pop("mtp_hidden"), micro,
                                       chunk=chunk)}
  return (*sums, aux)
