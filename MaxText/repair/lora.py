"""LoRA repair in-process: adapters trained on a pool of (prompt, target) pairs with the trainer's
own machinery (the model with `lora_rank` adapters, train/state.py's init on the loaded base,
train/optimizer.py's AdamW, train/step.py's step with the adapters alone trained), no subprocess
and no files; the result is a new model with the adapters in its parameters, the original
untouched (its `save_peft` writes them as a PEFT folder).

The pool is one batch: each pair is a row (prompt ids, then the target's ids), padded to a power
of two of rows and of length; the loss is the cross-entropy of the target tokens only (the
prompt's positions and the padding are out of the mask). The learning rate is constant (no
warmup), weight decay off: a repair is a few dozen steps on a handful of examples.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from MaxText.config.load import replace
from MaxText.decoding.engine import MIN_PROMPT_BUCKET, Engine, bucket
from MaxText.inference import InferenceModel
from MaxText.models.registry import make_model_def
from MaxText.train.optimizer import learning_rate_schedule, make_optimizer
from MaxText.train.state import init_state, state_shardings, trained
from MaxText.train.step import make_train_step


def pool_batch(pairs: Sequence[tuple[list[int], list[int]]]) -> dict[str, np.ndarray]:
  """The training batch of (prompt ids, target ids) pairs (module docstring)."""
  if not pairs:
    raise ValueError("lora_finetune needs a non-empty pool of (prompt, target) pairs")
  for i, (p, t) in enumerate(pairs):
    if not p or not t:
      raise ValueError(f"pool pair {i} has an empty {'prompt' if not p else 'target'}")
  R = bucket(len(pairs))
  S = bucket(max(len(p) + len(t) - 1 for p, t in pairs), MIN_PROMPT_BUCKET)
  batch = {k: np.zeros((R, S), np.int32) for k in ("inputs", "targets", "inputs_segmentation",
                                                   "inputs_position", "targets_segmentation")}
  for r, (p, t) in enumerate(pairs):
    ids = [*p, *t]
    n = len(ids) - 1
    batch["inputs"][r, :n], batch["targets"][r, :n] = ids[:-1], ids[1:]
    batch["inputs_segmentation"][r, :n] = 1
    batch["inputs_position"][r, :n] = np.arange(n)
    batch["targets_segmentation"][r, len(p) - 1:n] = 1        # the target tokens only
  return batch


def finetune(inference: InferenceModel, pairs: Sequence[tuple[list[int], list[int]]], *,
             rank: int, alpha: float, steps: int, learning_rate: float, targets: str,
             seed: int) -> tuple[InferenceModel, list[float]]:
  """(a model with trained adapters, the pool loss before each step)."""
  if rank < 1 or steps < 1:
    raise ValueError(f"rank={rank} and steps={steps} must be >= 1")
  cfg = inference.cfg
  if cfg.lora_rank:
    raise ValueError(f"the model already has adapters (lora_rank={cfg.lora_rank}): repair its "
                     f"base, or merge them first")
  if cfg.weight_bits:
    raise ValueError(f"weight_bits={cfg.weight_bits}: adapters train on a float base")
  cfg2 = replace(cfg, lora_rank=rank, lora_alpha=alpha, lora_targets=targets,
                 learning_rate=learning_rate, lr_schedule="constant", warmup_steps=0,
                 weight_decay=0.0, steps=steps)
  engine = inference.engine
  mcfg2 = dataclasses.replace(engine.mcfg, lora_rank=rank, lora_alpha=alpha, lora_targets=targets)
  model_def = make_model_def(mcfg2)
  tx = make_optimizer(cfg2, trained(model_def.logical_axes, True))
  shardings = state_shardings(model_def, tx, engine.mesh, engine.rules, adapters_only=True)
  state = init_state(mcfg2, seed, tx, shardings, params=inference.params)
  step = jax.jit(make_train_step(model_def, tx, mesh=engine.mesh, rules=engine.rules,
                                 grad_accum=1, z_loss_weight=0.0,
                                 lr_schedule=learning_rate_schedule(cfg2), adapters_only=True),
                 donate_argnums=(0,))
  batch = jax.device_put(pool_batch(pairs), NamedSharding(engine.mesh, PartitionSpec()))
  losses = []
  for _ in range(steps):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  engine2 = Engine(mcfg2, engine.mesh, engine.rules,
                   cache_dtype=cfg.cache_dtype, batch_size=engine.batch_size,
                   max_cache_length=engine.max_cache_length)
  model = InferenceModel(cfg2, engine2, state["params"], inference.tokenizer,
                         inference.tokenizer_source, inference.eos_ids)
  return model, losses
