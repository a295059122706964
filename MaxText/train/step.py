"""train.py's step: the pre-training / SFT / LoRA objective (MaxText/methods/pretrain.py: masked
cross-entropy + optional z-loss, whole or chunked, + the family's auxiliary loss) on the one update
builder (MaxText/train/update.py: gradient accumulation, the pipeline schedule, ZeRO-1, the guarded
AdamW update, the family's changes outside the gradient, the jit with every sharding pinned). What
a family adds (its `AuxTerms`, MaxText/models/family.py) comes in as `aux_terms`: this module names
no family and no parameter."""
from __future__ import annotations

from typing import Callable

import optax
from jax.sharding import Mesh, NamedSharding

from MaxText.data.batch import BATCH_KEYS
from MaxText.layers import pipeline
from MaxText.methods.registry import objective
from MaxText.models.family import AuxTerms
from MaxText.models.model_def import ModelDef
from MaxText.sharding.rules import Rules
from MaxText.train.optimizer import Optimizer
from MaxText.train.state import TrainState
from MaxText.train.update import (applied_learning_rate, check_state_dtypes, guarded_update,
                                  jit_update, keep_if, make_update, moment_shardings)

__all__ = ["applied_learning_rate", "check_state_dtypes", "guarded_update", "jit_train_step",
           "keep_if", "make_train_step", "moment_shardings"]


def make_train_step(model_def: ModelDef, tx: Optimizer, *, mesh: Mesh,
                    rules: Rules, grad_accum: int, z_loss_weight: float,
                    lr_schedule: optax.Schedule, aux_terms: AuxTerms | None = None,
                    loss_chunk_length: int = 0, adapters_only: bool = False,
                    schedule: pipeline.Schedule | None = None) -> Callable:
  """(state, batch[, shardings]) → (new state, metrics: loss, z_loss, tokens, grad_norm, lr,
  finite, batch_checksum, the family's). `adapters_only` (LoRA): only the adapters are trained;
  `schedule`: the pipeline schedule each micro-batch's decoder runs under."""
  return make_update(objective("pretrain", z_loss_weight=z_loss_weight, chunk=loss_chunk_length),
                     model_def, tx, mesh=mesh, rules=rules, lr_schedule=lr_schedule,
                     grad_accum=grad_accum, aux_terms=aux_terms, adapters_only=adapters_only,
                     schedule=schedule)


def jit_train_step(step_fn: Callable, state_shardings: TrainState,
                   batch_shardings: NamedSharding | dict[str, NamedSharding], mesh: Mesh):
  """`batch_shardings`: per batch key (the trainer's row keys), or one for the token arrays."""
  if isinstance(batch_shardings, NamedSharding):
    batch_shardings = {k: batch_shardings for k in BATCH_KEYS}
  return jit_update(step_fn, state_shardings, batch_shardings, mesh)
