"""The one update builder: a training method's objective (MaxText/methods/objective.py) → its
jitted optimizer step. Every method — pre-training, SFT and LoRA (methods/pretrain.py),
distillation (methods/distill.py), DPO (methods/dpo.py), GRPO (methods/grpo.py) — runs this one
path; what it owns, once:

- LoRA (`adapters_only`): gradients, the optimizer and updates cover the adapters only
  (layers/lora.py); the rest of the parameters pass through unchanged, and so do the family's
  updates outside the gradient (they would change the frozen base);
- gradient accumulation (`grad_accum` = A): micro-batch j = rows j, j + A, j + 2A, … (every
  device's contiguous block of rows holds an equal share of each micro-batch, so no rows move
  between devices), one `lax.scan` summing the gradients, losses and metric sums;
- the pipeline schedule over the `stage` axis (layers/pipeline.py) each micro-batch's decoder runs
  under (`schedule`);
- ZeRO-1 (`tx.shard_over_data`): the gradients reduce-scattered onto the moments' sharding, the
  update there, the new parameters back on theirs (`guarded_update`);
- the non-finite guard: a non-finite loss or gradient never reaches the parameters, the optimizer
  moments or the family's updates (they stay as they were; `finite` 0 in the metrics);
- the family's terms (`aux_terms`, MaxText/models/family.py: `AuxTerms`): its auxiliary loss
  (when the objective `adds_aux_loss`), its changes outside the gradient after the update (e.g.
  the MoE router bias) from every micro-batch's statistics, its metrics;
- the shared metrics: grad_norm, lr (the rate this update used), finite, and with the objective's
  `checksum` batch_checksum (computed here rather than by a program of its own per step: no second
  launch, rendezvous and read-back per step);
- the state's dtypes kept (a TypeError at trace time otherwise), the step counted (`count_step`),
  the jit with every sharding pinned and the state donated (`jit_update`), the compile options
  (`compile_update`).
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from MaxText.checkpoint.checksum import batch_checksum
from MaxText.layers import lora, pipeline
from MaxText.methods.objective import Objective, combine, identity
from MaxText.models.family import AuxTerms
from MaxText.models.model_def import ModelDef
from MaxText.runtime import cpu_devices
from MaxText.sharding.rules import BATCH_AXES, Rules, constrain, use_rules
from MaxText.train.optimizer import Optimizer, find_state


def applied_learning_rate(opt_state: Any, lr_schedule: optax.Schedule) -> jax.Array:
  """The rate this step's update uses: the schedule at optax's own count of applied updates (the
  train state's step also counts the non-finite steps that were skipped; optax's count does not)."""
  return jnp.asarray(lr_schedule(find_state(opt_state, optax.ScaleByScheduleState).count))


def keep_if(finite: jax.Array, new: Any, old: Any) -> Any:
  return jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)


def check_state_dtypes(new: Any, old: Any) -> None:
  """At trace time: a TypeError naming the leaves whose dtype the step would change (a compiled
  step must return the state in the dtypes it takes it in: it is called with what it returned)."""
  changed = [f"{jax.tree_util.keystr(path)}: {a.dtype} -> {b.dtype}"
             for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(old),
                                     jax.tree.leaves(new)) if a.dtype != b.dtype]
  if changed:
    raise TypeError(f"the train step changes {len(changed)} dtypes of its state: "
                    + "; ".join(changed[:3]) + ("; ..." if len(changed) > 3 else ""))


def moment_shardings(opt_shardings: Any) -> Any:
  """The shardings of the AdamW first moment (a tree like the trained parameters) in the
  optimizer state's shardings."""
  return find_state(opt_shardings, optax.ScaleByAdamState).mu


def guarded_update(tx: Optimizer, grads: Any, opt_state: Any, params: Any,
                   loss: jax.Array, zero: tuple[Any, Any] | None = None
                   ) -> tuple[Any, Any, jax.Array, jax.Array]:
  """(new params, new optimizer state, gradient norm, finite): the optimizer's update
  (`Optimizer.apply`: the fused AdamW, train/optimizer.py — the one update path; optax's chain is
  its oracle in tests/optax_oracle.py), except that a non-finite loss or gradient never reaches the
  parameters or the optimizer moments (both stay as they were). `zero` (ZeRO-1,
  sharding/zero.py): (the moments' shardings, the parameters'): the gradients are reduce-scattered
  onto the first, the update runs there, on each device's part of the moments, and the new
  parameters come back on the second."""
  whole, gather = params, None
  if zero is not None:
    grads = jax.lax.with_sharding_constraint(grads, zero[0])
    params = jax.lax.with_sharding_constraint(params, zero[0])
    gather = lambda tree: jax.lax.with_sharding_constraint(tree, zero[1])
  grad_norm = optax.tree.norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  new_params, new_opt_state = tx.apply(grads, opt_state, params, grad_norm, finite,
                                       whole=whole, gather=gather)
  return new_params, new_opt_state, grad_norm, finite


def micro_axes(x: jax.Array) -> tuple:
  """The logical axes of a micro-batch's array: rows (and positions for [rows, S] arrays; the
  rest of a media slot's [rows, N, ...] unsplit)."""
  return BATCH_AXES if x.ndim == 2 else (BATCH_AXES[0], *[None] * (x.ndim - 1))


def split_micro_batches(batch: Any, grad_accum: int) -> Any:
  """[B, ...] → [A, B / A, ...] with micro-batch j = rows j, j + A, j + 2A, … (module docstring)."""
  return jax.tree.map(
      lambda x: x.reshape(x.shape[0] // grad_accum, grad_accum, *x.shape[1:]).swapaxes(0, 1),
      batch)


def make_update(objective: Objective, model_def: ModelDef, tx: Optimizer, *, mesh: Mesh,
                rules: Rules, lr_schedule: optax.Schedule, grad_accum: int = 1,
                aux_terms: AuxTerms | None = None, adapters_only: bool = False,
                schedule: pipeline.Schedule | None = None, count_step: bool = True) -> Callable:
  """(state, batch[, side][, shardings]) → (the state after one optimizer update, metrics): the
  module docstring's step for `objective`. `side` goes to the objective's loss as it is;
  `shardings` (the state's, given by `jit_update`) place ZeRO-1's update; `count_step`: the
  state's step + 1 (else left to the caller: GRPO counts a step of several updates)."""
  if adapters_only:
    split, join = lora.split, lora.join
  else:
    split, join = (lambda p: (p, {})), (lambda t, _: t)

  def micro_loss(trained, frozen, micro, side):
    out = objective.loss(join(trained, frozen), micro, model_def, side)
    loss, family = out.loss, None   # None: the family's terms are not used
    if aux_terms is not None and out.aux is not None:
      extra, family = aux_terms.loss(out.aux)
      if objective.adds_aux_loss:
        loss = loss + extra
    return loss, (out.sums, family, jnp.asarray(out.tokens, jnp.float32))

  grad_fn = model_def.at_precision(jax.value_and_grad(micro_loss, has_aux=True))

  def step(state: dict, batch: dict, side: Any = None, shardings: dict | None = None):
    zero_shardings = None   # ZeRO-1: (the moments' shardings, the trained parameters')
    if shardings is not None and tx.shard_over_data:
      zero_shardings = (moment_shardings(shardings["opt_state"]), split(shardings["params"])[0])
    with use_rules(mesh, rules), pipeline.use_schedule(schedule):
      params, frozen = split(state["params"])   # params: what is trained
      totals = objective.totals(batch)
      if grad_accum == 1:
        (loss, (sums, family, tokens)), grads = grad_fn(params, frozen, {**batch, **totals}, side)
      else:
        micro_batches = split_micro_batches(batch, grad_accum)

        def accumulate(carry, micro):
          micro = {**jax.tree.map(lambda x: constrain(x, micro_axes(x)), micro), **totals}
          (l, (s, f, n)), g = grad_fn(params, frozen, micro, side)
          acc_g, acc_l, acc_s, acc_f, acc_n = carry
          return (jax.tree.map(jnp.add, acc_g, g), acc_l + l, combine(acc_s, s),
                  jax.tree.map(jnp.add, acc_f, f), acc_n + n), None

        first = {**jax.tree.map(lambda x: x[0], micro_batches), **totals}
        (l_shape, (s_shape, f_shape, _)), _ = jax.eval_shape(grad_fn, params, frozen, first, side)
        f32_zero = jnp.zeros((), jnp.float32)
        zero = (jax.tree.map(jnp.zeros_like, params), jnp.zeros(l_shape.shape, l_shape.dtype),
                identity(s_shape), jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), f_shape),
                f32_zero)
        (grads, loss, sums, family, tokens), _ = jax.lax.scan(accumulate, zero, micro_batches)
      divisor, metrics = objective.finish(loss, sums, tokens, totals)
      if divisor is not None:
        grads = jax.tree.map(lambda g: g / divisor, grads)
      new_params, opt_state, grad_norm, finite = guarded_update(tx, grads, state["opt_state"],
                                                                params, loss, zero_shardings)
      new_params = join(new_params, frozen)
      if aux_terms is not None and family is not None and not adapters_only:
        new_params = keep_if(finite, aux_terms.update(new_params, family), new_params)
      new_state = {**state, "params": new_params, "opt_state": opt_state}
      if count_step:
        new_state["step"] = state["step"] + 1
      check_state_dtypes(new_state, state)
      metrics = {**metrics, "grad_norm": grad_norm,
                 "lr": applied_learning_rate(state["opt_state"], lr_schedule),
                 "finite": finite.astype(jnp.float32)}
      if objective.checksum:
        metrics["batch_checksum"] = batch_checksum(batch)
      if aux_terms is not None and family is not None:
        metrics.update(aux_terms.metrics(family, jnp.maximum(tokens, 1.0)))
    return new_state, metrics

  return step


def jit_update(step: Callable, state_shardings: Any, batch_shardings: Any, mesh: Mesh,
               side_shardings: Any = None) -> Callable:
  """`step` (`make_update`'s) jitted with every sharding pinned — the state's, the batch's, the
  side input's when given (then a third argument), every metric replicated — and the state
  donated (never the side input)."""
  replicated = NamedSharding(mesh, PartitionSpec())   # every metric (a prefix of the dict)
  step = functools.partial(step, shardings=state_shardings)   # ZeRO-1's placements
  in_shardings = ((state_shardings, batch_shardings) if side_shardings is None
                  else (state_shardings, batch_shardings, side_shardings))
  return jax.jit(step, in_shardings=in_shardings, out_shardings=(state_shardings, replicated),
                 donate_argnums=(0,))


def compile_update(jitted: Callable, *abstract_args: Any, platform: str, hot_path: str):
  """The jitted step lowered for `abstract_args` and compiled with the step's compile options
  (runtime/cpu_devices.py: `step_compiler_options`)."""
  return jitted.lower(*abstract_args).compile(
      compiler_options=cpu_devices.step_compiler_options(platform, hot_path))
