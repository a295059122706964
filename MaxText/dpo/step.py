"""DPO's programs on the training mesh besides its optimizer step: the shardings of a batch of
pairs and the summed response log-probabilities of one (the policy's, or the reference's: with
LoRA the base under the adapters, no copy — losses/logprobs.py: `base_only`). The batch's layout
and the loss are the DPO objective's (MaxText/methods/dpo.py), whose step is the update
builder's (MaxText/train/update.py).
"""
from __future__ import annotations

from typing import Callable

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from MaxText.losses.logprobs import base_only
from MaxText.methods.dpo import TOKEN_KEYS, batch_loss, side_logps
from MaxText.models.model_def import ModelDef
from MaxText.sharding.rules import Rules, logical_to_spec, use_rules

__all__ = ["ROW_AXES", "SIDES", "TOKEN_KEYS", "batch_loss", "batch_shardings", "logical_to_spec",
           "make_sums_fn", "row_parts", "side_logps"]

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
