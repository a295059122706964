"""The optax optimizer: global-norm clipping → AdamW (decoupled weight decay on matrices only)
with a warmup + cosine, warmup-stable-decay (WSD) or constant learning-rate schedule.

"Matrices" are told apart by the parameters' logical axes, not their rank: a scanned stack of norm
scales is [layers, D] but is still a vector per layer and is not decayed.

A family's frozen parameters (`Family.frozen`: top-level names, e.g. a carried
multi-token-prediction block) get updates of -0.0 after AdamW: p + (-0.0) is p bit for bit for every p, signed zeros
included. (Their gradients are zero, so their AdamW moments stay zero; they still take optimizer
state, which keeps the state's structure that of the parameters.)"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import optax

from MaxText.config.schema import Config


def learning_rate_schedule(cfg: Config) -> optax.Schedule:
  peak, steps, warmup = cfg.learning_rate, cfg.steps, min(cfg.warmup_steps, cfg.steps)
  final = peak * cfg.final_lr_fraction
  warm = optax.linear_schedule(0.0, peak, max(warmup, 1))
  if cfg.lr_schedule == "constant":
    return optax.join_schedules([warm, optax.constant_schedule(peak)], [warmup])
  if cfg.lr_schedule == "cosine":
    cos = optax.cosine_decay_schedule(peak, max(steps - warmup, 1), alpha=cfg.final_lr_fraction)
    return optax.join_schedules([warm, cos], [warmup])
  # wsd: warmup, hold the peak, then decay linearly to `final` over the last wsd_decay_fraction
  decay = max(int(round(steps * cfg.wsd_decay_fraction)), 1)
  stable = max(steps - warmup - decay, 0)
  return optax.join_schedules(
      [warm, optax.constant_schedule(peak), optax.linear_schedule(peak, final, decay)],
      [warmup, warmup + stable])


def decay_mask(logical_axes):
  """True for parameters with at least two axes besides the stacked "layers" axis."""
  return jax.tree.map(lambda axes: sum(a != "layers" for a in axes) >= 2, logical_axes,
                      is_leaf=lambda x: isinstance(x, tuple))


def freeze(frozen_mask) -> optax.GradientTransformation:
  """Updates of -0.0 where `frozen_mask` is True (x + -0.0 == x for every x, signed zeros
  included; +0.0 would turn -0.0 into +0.0)."""
  return optax.stateless(lambda updates, params=None: jax.tree.map(
      lambda u, frozen: jnp.full_like(u, -0.0) if frozen else u, updates, frozen_mask))


def make_optimizer(cfg: Config, logical_axes,
                   frozen: Sequence[str] = ()) -> optax.GradientTransformation:
  """`logical_axes`: the parameters' logical axis names (ModelDef.logical_axes); `frozen`: the
  top-level parameters left out of training."""
  tx = optax.adamw(learning_rate_schedule(cfg), b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.adam_eps,
                   weight_decay=cfg.weight_decay, mask=decay_mask(logical_axes))
  if cfg.max_grad_norm > 0:
    tx = optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), tx)
  if not frozen:
    return tx
  mask = {name: jax.tree.map(lambda _, n=name: n in frozen, axes,
                             is_leaf=lambda x: isinstance(x, tuple))
          for name, axes in logical_axes.items()}
  return optax.chain(tx, freeze(mask))
