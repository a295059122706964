"""Pre-training, SFT and LoRA (train.py): the masked token cross-entropy (+ optional z-loss; whole
or chunked, losses/token_loss.py), summed over the tokens and divided by them — the family's
auxiliary loss added to the sum. Metrics: loss, z_loss (per token), tokens, batch_checksum."""
from __future__ import annotations

import dataclasses

from MaxText.losses.token_loss import token_loss_sums
from MaxText.methods.objective import Micro, Objective, per_token
from MaxText.methods.registry import Method


@dataclasses.dataclass(frozen=True)
class TokenCrossEntropy(Objective):
  z_loss_weight: float = 0.0
  chunk: int = 0          # loss_chunk_length

  checksum = True

  def loss(self, params, micro, model_def, side):
    del side
    nll, z, n, aux = token_loss_sums(model_def, params, micro, z_loss_weight=self.z_loss_weight,
                                     chunk=self.chunk)
    return Micro(nll, {"z_loss": z}, aux, n)

  def finish(self, loss, sums, tokens, totals):
    del totals
    return per_token(loss, sums, tokens)


METHOD = Method("pretrain", TokenCrossEntropy, "train.py: pre-training, SFT, LoRA")
