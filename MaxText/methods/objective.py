"""What a training method is to the update builder (MaxText/train/update.py): its objective.

The builder owns everything the methods share — LoRA's split into trained and frozen parameters,
the micro-batch scan of gradient accumulation, the pipeline schedule, ZeRO-1's placements, the
non-finite guard around the optimizer update, the family's auxiliary loss and its changes outside
the gradient (the MoE router bias), the shared metrics (grad_norm, lr, finite, batch_checksum),
the jit with every sharding pinned. A method supplies only an `Objective`:

- `totals(batch)`: scalars of the whole batch every micro-batch needs (e.g. the step's pairs, or
  its scored tokens, to normalise by); they join each micro-batch under their own keys;
- `loss(params, micro, model_def, side)` → `Micro`: one micro-batch's share of the step's loss
  (the shares are summed: a loss normalised by `totals`, or a sum the builder divides by the
  tokens), its metric sums, the model's auxiliary outputs and the tokens the family's metrics
  average over. `side`: the step's third argument, never differentiated nor updated (a
  distillation teacher's parameters), or None;
- `finish(loss, sums, tokens, totals)` → (the divisor of the summed gradients, or None: they are
  the step's already; the step's metrics).

`adds_aux_loss`: the family's auxiliary loss (e.g. MoE load balancing, a sum over tokens) joins the
loss (a per-token objective); else only its statistics are kept (for the router-bias update and
the metrics). `checksum`: the metrics carry the batch's checksum (train.py's rows, whose resume
checks it). Methods are keyed as families are: MaxText/methods/registry.py.
"""
from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from MaxText.models.model_def import ModelDef


class Micro(NamedTuple):
  """An objective's result on one micro-batch (module docstring)."""
  loss: Any                 # its share of the step's loss (summed over the micro-batches)
  sums: dict                # metric sums (added; keys ending in _min / _max: their min / max)
  aux: Any = None           # the model's auxiliary outputs (None: the family's terms are not used)
  tokens: Any = 0.0         # what the family's auxiliary metrics are averaged over


class Objective:
  """A training method's objective (module docstring); subclasses are frozen dataclasses."""

  adds_aux_loss: ClassVar[bool] = True
  checksum: ClassVar[bool] = False

  def totals(self, batch: dict) -> dict[str, jax.Array]:
    del batch
    return {}

  def loss(self, params: Any, micro: dict, model_def: ModelDef, side: Any) -> Micro:
    raise NotImplementedError

  def finish(self, loss: jax.Array, sums: dict, tokens: jax.Array, totals: dict
             ) -> tuple[jax.Array | None, dict[str, jax.Array]]:
    raise NotImplementedError


def per_token(loss: jax.Array, sums: dict, tokens: jax.Array
              ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The finish of an objective summed over tokens: the gradient, the loss and every sum divided
  by the step's tokens (at least 1), which are reported as `tokens`."""
  denom = jnp.maximum(tokens, 1.0)
  return denom, {"loss": loss / denom, **{k: v / denom for k, v in sums.items()},
                 "tokens": tokens}


def combine(a: dict, b: dict) -> dict:
  """Two micro-batches' metric sums as one (add; `_min` / `_max` keys: min / max)."""
  return {k: (jnp.minimum if k.endswith("_min") else jnp.maximum if k.endswith("_max")
              else jnp.add)(a[k], b[k]) for k in a}


def identity(shapes: dict) -> dict:
  """The sums `combine` starts from: 0, or +inf / -inf for the `_min` / `_max` keys."""
  fill = lambda k: jnp.inf if k.endswith("_min") else -jnp.inf if k.endswith("_max") else 0
  return {k: jnp.full(s.shape, fill(k), s.dtype) for k, s in shapes.items()}
