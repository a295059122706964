"""The jitted train step: masked cross-entropy (+ optional z-loss; whole or chunked, `losses/token_loss.py`;
+ the family's auxiliary loss), gradient accumulation over micro-batches, clipping + AdamW, then the
family's changes outside the gradient, with the state donated and every sharding pinned. What a
family adds (its `AuxTerms`, MaxText/models/family.py) comes in as `aux_terms`: this module names no
family and no parameter."""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from MaxText.checkpoint.checksum import batch_checksum
from MaxText.data.batch import BATCH_KEYS
from MaxText.layers import lora, pipeline
from MaxText.losses.token_loss import token_loss_sums
from MaxText.models.family import AuxTerms
from MaxText.models.model_def import ModelDef
from MaxText.sharding.rules import BATCH_AXES, Rules, constrain, use_rules
from MaxText.train.optimizer import Optimizer, find_state
from MaxText.train.state import TrainState


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


def make_train_step(model_def: ModelDef, tx: Optimizer, *, mesh: Mesh,
                    rules: Rules, grad_accum: int, z_loss_weight: float,
                    lr_schedule: optax.Schedule, aux_terms: AuxTerms | None = None,
                    loss_chunk_length: int = 0, adapters_only: bool = False,
                    schedule: pipeline.Schedule | None = None) -> Callable:
  """`adapters_only` (LoRA): gradients, the optimizer and updates cover the adapters only
  (layers/lora.py); the rest of the parameters pass through unchanged, and so do the family's
  updates outside the gradient (they would change the frozen base). `schedule`: the pipeline
  schedule over the `stage` axis (layers/pipeline.py) each micro-batch's decoder runs under."""
  if adapters_only:
    split, join = lora.split, lora.join
  else:
    split, join = (lambda p: (p, {})), (lambda t, _: t)

  def micro_loss(trained, frozen, micro):
    params = join(trained, frozen)
    nll, z, n, aux = token_loss_sums(model_def, params, micro, z_loss_weight=z_loss_weight,
                                     chunk=loss_chunk_length)
    sums = {}
    if aux_terms is not None:
      extra, sums = aux_terms.loss(aux)
      nll = nll + extra
    return nll, (z, n, sums)

  grad_fn = model_def.at_precision(jax.value_and_grad(micro_loss, has_aux=True))

  def step(state: TrainState, batch: dict[str, jax.Array], shardings: TrainState | None = None):
    """`shardings` (the state's, given by `jit_train_step`): with the optimizer moments sharded
    over the data axes (ZeRO-1, `tx.shard_over_data`), the update runs on their sharding and the
    new parameters go back to theirs."""
    zero_shardings = None   # ZeRO-1: (the moments' shardings, the trained parameters')
    if shardings is not None and tx.shard_over_data:
      zero_shardings = (moment_shardings(shardings["opt_state"]), split(shardings["params"])[0])
    with use_rules(mesh, rules), pipeline.use_schedule(schedule):
      params, frozen = split(state["params"])   # params: what is trained
      if grad_accum == 1:
        (nll, (z, n, sums)), grads = grad_fn(params, frozen, batch)
      else:
        # micro-batch j = rows j, j+A, j+2A, …: every device's contiguous block of rows holds an
        # equal share of each micro-batch, so no rows move between devices
        micro_batches = jax.tree.map(
            lambda x: x.reshape(x.shape[0] // grad_accum, grad_accum, *x.shape[1:]).swapaxes(0, 1),
            batch)

        def accumulate(carry, micro):
          micro = {k: constrain(x, BATCH_AXES if x.ndim == 2 else
                                (BATCH_AXES[0], *[None] * (x.ndim - 1)))
                   for k, x in micro.items()}   # token arrays [B, S]; media slots [B, N, ...]
          (l, (zz, nn, mm)), g = grad_fn(params, frozen, micro)
          acc_g, acc_l, acc_z, acc_n, acc_m = carry
          return (jax.tree.map(jnp.add, acc_g, g), acc_l + l, acc_z + zz, acc_n + nn,
                  jax.tree.map(jnp.add, acc_m, mm)), None

        f32_zero = jnp.zeros((), jnp.float32)
        first = jax.tree.map(lambda x: x[0], micro_batches)
        sums_zero = jax.tree.map(jnp.zeros_like,
                                 jax.eval_shape(grad_fn, params, frozen, first)[0][1][2])
        zero = (jax.tree.map(jnp.zeros_like, params), f32_zero, f32_zero, f32_zero, sums_zero)
        (grads, nll, z, n, sums), _ = jax.lax.scan(accumulate, zero, micro_batches)
      denom = jnp.maximum(n, 1.0)
      grads = jax.tree.map(lambda g: g / denom, grads)
      new_params, opt_state, grad_norm, finite = guarded_update(tx, grads, state["opt_state"],
                                                                params, nll, zero_shardings)
      new_params = join(new_params, frozen)
      if aux_terms is not None and not adapters_only:
        new_params = keep_if(finite, aux_terms.update(new_params, sums), new_params)
      new_state = {"step": state["step"] + 1,
                   "params": new_params,
                   "opt_state": opt_state}
      check_state_dtypes(new_state, state)
      metrics = {"loss": nll / denom, "z_loss": z / denom, "tokens": n, "grad_norm": grad_norm,
                 "lr": applied_learning_rate(state["opt_state"], lr_schedule),
                 "finite": finite.astype(jnp.float32),
                 # computed here rather than by a program of its own per step: no second launch,
                 # rendezvous and read-back per step
                 "batch_checksum": batch_checksum(batch)}
      if aux_terms is not None:
        metrics.update(aux_terms.metrics(sums, denom))
    return new_state, metrics

  return step


def jit_train_step(step_fn: Callable, state_shardings: TrainState,
                   batch_shardings: NamedSharding | dict[str, NamedSharding], mesh: Mesh):
  """`batch_shardings`: per batch key (the trainer's row keys), or one for the token arrays."""
  replicated = NamedSharding(mesh, PartitionSpec())   # every metric (a prefix of the dict)
  if isinstance(batch_shardings, NamedSharding):
    batch_shardings = {k: batch_shardings for k in BATCH_KEYS}
  step_fn = functools.partial(step_fn, shardings=state_shardings)
  return jax.jit(step_fn, in_shardings=(state_shardings, batch_shardings),
                 out_shardings=(state_shardings, replicated), donate_argnums=(0,))
