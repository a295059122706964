"""Distillation's compiled step on the training mesh: the teacher's and the student's forward on a
batch of train.py's rows, the distillation loss (MaxText/losses/distill.py: the divergence mixed
with the hard labels' cross-entropy, the heads chunk by chunk), gradient accumulation over
micro-batches, and the optimizer update (`train/step.py: guarded_update`) of the student only. The
teacher's parameters are an argument of the step (on the mesh, by their own logical axes), never
updated, never differentiated.

Metrics: loss (the mixed loss per token), distill_divergence and distill_ce (its two parts per
token), tokens, grad_norm, lr, finite, batch_checksum, and the student family's auxiliary metrics
(its `AuxTerms`, e.g. MoE balancing, whose loss is added as in pre-training).
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from MaxText.checkpoint.checksum import batch_checksum
from MaxText.layers import lora
from MaxText.losses.distill import DistillSpec, distill_sums
from MaxText.models.family import AuxTerms
from MaxText.models.model_def import ModelDef
from MaxText.sharding.rules import BATCH_AXES, Rules, constrain, use_rules
from MaxText.train.step import applied_learning_rate, guarded_update, keep_if, moment_shardings


def micro_sums(model_def: ModelDef, teacher_def: ModelDef, params, teacher_params, micro: dict,
               *, spec: DistillSpec, chunk: int):
  """(loss sum, (divergence sum, cross-entropy sum), token count, the student's auxiliary
  outputs) of one micro-batch."""
  args = (micro["inputs"], micro["inputs_position"], micro["inputs_segmentation"])
  mask_BS = micro["targets_segmentation"] != 0
  teacher_hidden, _ = teacher_def.apply_hidden(jax.lax.stop_gradient(teacher_params), *args)
  hidden, aux = model_def.apply_hidden(params, *args)
  loss, stats, n = distill_sums(model_def.head, params, hidden, teacher_def.head, teacher_params,
                                teacher_hidden, micro["targets"], mask_BS, spec, chunk)
  return loss, stats, n, aux


def make_distill_step(model_def: ModelDef, teacher_def: ModelDef, tx, *, mesh: Mesh,
                      rules: Rules, grad_accum: int, lr_schedule: optax.Schedule,
                      spec: DistillSpec, chunk: int, aux_terms: AuxTerms | None = None,
                      adapters_only: bool = False) -> Callable:
  """(state, teacher params, batch[, shardings]) → (new state, metrics), as train/step.py's
  `make_train_step` with the distillation loss (module docstring)."""
  if adapters_only:
    split, join = lora.split, lora.join
  else:
    split, join = (lambda p: (p, {})), (lambda t, _: t)

  def micro_loss(trained, frozen, teacher, micro):
    loss, (kd, ce), n, aux = micro_sums(model_def, teacher_def, join(trained, frozen), teacher,
                                        micro, spec=spec, chunk=chunk)
    sums = {}
    if aux_terms is not None:
      extra, sums = aux_terms.loss(aux)
      loss = loss + extra
    return loss, (kd, ce, n, sums)

  grad_fn = model_def.at_precision(jax.value_and_grad(micro_loss, has_aux=True))

  def step(state, teacher, batch, shardings=None):
    zero_shardings = None
    if shardings is not None and tx.shard_over_data:
      zero_shardings = (moment_shardings(shardings["opt_state"]), split(shardings["params"])[0])
    with use_rules(mesh, rules):
      params, frozen = split(state["params"])
      if grad_accum == 1:
        (loss, (kd, ce, n, sums)), grads = grad_fn(params, frozen, teacher, batch)
      else:
        micro_batches = jax.tree.map(   # micro-batch j = rows j, j+A, ... (as train/step.py)
            lambda x: x.reshape(x.shape[0] // grad_accum, grad_accum, *x.shape[1:]).swapaxes(0, 1),
            batch)

        def accumulate(carry, micro):
          micro = {k: constrain(x, BATCH_AXES) for k, x in micro.items()}
          (l, (k_, c_, n_, s_)), g = grad_fn(params, frozen, teacher, micro)
          return jax.tree.map(jnp.add, carry, (g, l, k_, c_, n_, s_)), None

        first = jax.tree.map(lambda x: x[0], micro_batches)
        out_shape = jax.eval_shape(grad_fn, params, frozen, teacher, first)
        zero = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                            (out_shape[1], out_shape[0][0], *out_shape[0][1]))
        (grads, loss, kd, ce, n, sums), _ = jax.lax.scan(accumulate, zero, micro_batches)
      denom = jnp.maximum(n, 1.0)
      grads = jax.tree.map(lambda g: g / denom, grads)
      new_params, opt_state, grad_norm, finite = guarded_update(tx, grads, state["opt_state"],
                                                                params, loss, zero_shardings)
      new_params = join(new_params, frozen)
      if aux_terms is not None and not adapters_only:
        new_params = keep_if(finite, aux_terms.update(new_params, sums), new_params)
      new_state = {"step": state["step"] + 1, "params": new_params, "opt_state": opt_state}
      metrics = {"loss": loss / denom, "distill_divergence": kd / denom, "distill_ce": ce / denom,
                 "tokens": n, "grad_norm": grad_norm,
                 "lr": applied_learning_rate(state["opt_state"], lr_schedule),
                 "finite": finite.astype(jnp.float32), "batch_checksum": batch_checksum(batch)}
      if aux_terms is not None:
        metrics.update(aux_terms.metrics(sums, denom))
    return new_state, metrics

  return step


def jit_distill_step(step_fn: Callable, state_shardings, teacher_shardings,
                     batch_shardings: dict[str, NamedSharding], mesh: Mesh):
  """The step jitted with every sharding pinned and the state donated (not the teacher's)."""
  replicated = NamedSharding(mesh, PartitionSpec())
  step_fn = functools.partial(step_fn, shardings=state_shardings)
  return jax.jit(step_fn, in_shardings=(state_shardings, teacher_shardings, batch_shardings),
                 out_shardings=(state_shardings, replicated), donate_argnums=(0,))
