"""Distillation (python -m MaxText.distill): the teacher's and the student's forward on a batch of
train.py's rows, the distillation loss (MaxText/losses/distill.py: the divergence mixed with the
hard labels' cross-entropy, the heads chunk by chunk) summed over the tokens and divided by them —
the student family's auxiliary loss added as in pre-training. The teacher's parameters are the
step's side input (on the mesh, by their own logical axes): never updated, never differentiated.

Metrics: loss (the mixed loss per token), distill_divergence and distill_ce (its two parts per
token), tokens, batch_checksum.
"""
from __future__ import annotations

import dataclasses

import jax

from MaxText.losses.distill import DistillSpec, distill_sums
from MaxText.methods.objective import Micro, Objective, per_token
from MaxText.methods.registry import Method
from MaxText.models.model_def import ModelDef


@dataclasses.dataclass(frozen=True)
class Distillation(Objective):
  teacher_def: ModelDef
  spec: DistillSpec
  chunk: int = 0          # loss_chunk_length

  checksum = True

  def loss(self, params, micro, model_def, side):
    args = (micro["inputs"], micro["inputs_position"], micro["inputs_segmentation"])
    mask_BS = micro["targets_segmentation"] != 0
    teacher = jax.lax.stop_gradient(side)
    teacher_hidden, _ = self.teacher_def.apply_hidden(teacher, *args)
    hidden, aux = model_def.apply_hidden(params, *args)
    loss, (kd, ce), n = distill_sums(model_def.head, params, hidden, self.teacher_def.head,
                                     side, teacher_hidden, micro["targets"], mask_BS, self.spec,
                                     self.chunk)
    return Micro(loss, {"distill_divergence": kd, "distill_ce": ce}, aux, n)

  def finish(self, loss, sums, tokens, totals):
    del totals
    return per_token(loss, sums, tokens)


METHOD = Method("distill", Distillation, "python -m MaxText.distill")
