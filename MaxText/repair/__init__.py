"""Repair tiers on an inspection model that need the trainer (so they live above the tools, which
never import `MaxText.train`): `Repairable` is an `Inspector` with `lora_finetune`.

  from MaxText import repair
  m = repair.load(hf_path="HF_DIR")          # or repair.wrap(params, cfg), repair.repairable(m)
  m2 = m.lora_finetune([("prompt", "target"), ...], rank=8, steps=50)   # m is unchanged
  m2.lora_losses, m2.forward(...), m2.save_peft("adapters/")            # PEFT for transformers
"""
from __future__ import annotations

from typing import Sequence

from MaxText import inspect as mi
from MaxText.inspect.model import Inspector, locked
from MaxText.repair import lora

__all__ = ["Repairable", "load", "repairable", "wrap"]


class Repairable(Inspector):
  """An Inspector with LoRA repair (lora.py)."""

  lora_losses: list[float] = []     # the pool's loss before each step of the lora_finetune made it

  @locked
  def lora_finetune(self, pool: Sequence, *, rank: int = 8, alpha: float | None = None,
                    steps: int = 50, learning_rate: float = 1e-3, targets: str = "",
                    seed: int = 0) -> "Repairable":
    """A copy of this model with LoRA adapters (`rank`, `alpha`: default 2 x rank, `targets`:
    the lora_targets regex) trained for `steps` on `pool`, a list of (prompt, target) pairs
    (prompt: text, ids or a prompt object; target: text or ids), in this process with the
    trainer's step. This model is unchanged."""
    pairs = []
    for i, pair in enumerate(pool):
      if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
        raise ValueError(f"pool item {i} is not a (prompt, target) pair: {pair!r:.100}")
      prompt, target = pair
      target_ids = (self.inference.tokenizer.encode(target) if isinstance(target, str) and
                    self.inference.tokenizer is not None else self.inference.encode(target))
      pairs.append((self.inference.encode(prompt), target_ids))
    model, losses = lora.finetune(
        self.inference, pairs, rank=rank, alpha=2.0 * rank if alpha is None else alpha,
        steps=steps, learning_rate=learning_rate, targets=targets, seed=seed)
    repaired = Repairable(model, self.attention)
    repaired.lora_losses = losses
    return repaired


def repairable(m: Inspector) -> Repairable:
  """`m`'s model (the same parameters, tokenizer and engine) with the repair tiers."""
  return Repairable(m.inference, m.attention)


def load(**kwargs) -> Repairable:
  """`MaxText.inspect.load` with the repair tiers."""
  return repairable(mi.load(**kwargs))


def wrap(params, cfg, **kwargs) -> Repairable:
  """`MaxText.inspect.wrap` with the repair tiers."""
  return repairable(mi.wrap(params, cfg, **kwargs))
