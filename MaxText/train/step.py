"""The jitted train step: masked cross-entropy (+ optional z-loss; `train/loss.py`), gradient
accumulation over micro-batches, clipping + AdamW, with the state donated and every sharding
pinned."""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from MaxText.sharding.rules import Rules, constrain, logical_to_spec, use_rules
from MaxText.train.loss import cross_entropy_sums, token_loss_sums  # noqa: F401 (re-exported)
from MaxText.train.state import ModelDef, TrainState

BATCH_KEYS = ("inputs", "targets", "inputs_segmentation", "inputs_position", "targets_segmentation")
BATCH_AXES = ("activation_batch", "activation_length")


def moe_terms(moe_stats: dict, aux_weight: float) -> dict:
  """From one micro-batch's routing statistics: the load-balancing loss (added to the summed
  loss weighted by the token count, so it averages like the cross-entropy) and the load."""
  from MaxText.layers.moe import aux_loss
  aux = aux_loss(moe_stats["counts"], moe_stats["probs"], moe_stats["tokens"])
  return {"aux_loss_sum": aux * moe_stats["tokens"], "weighted": aux_weight * aux * moe_stats["tokens"],
          "load": moe_stats["counts"], "dropped": moe_stats["dropped"]}


def moe_metrics(load_LE: jax.Array, aux_loss_mean: jax.Array, dropped: jax.Array) -> dict:
  """Expert load per layer as max/mean (1.0 = perfectly even), its worst layer, the aux loss and
  the token copies dropped (0 when dropless)."""
  ratio_L = jnp.max(load_LE, axis=1) / jnp.maximum(jnp.mean(load_LE, axis=1), 1e-9)
  out = {"moe_aux_loss": aux_loss_mean, "moe_dropped": dropped.astype(jnp.float32),
         "moe_load_max_over_mean": jnp.max(ratio_L)}
  out.update({f"moe_load_max_over_mean/layer_{i}": ratio_L[i] for i in range(load_LE.shape[0])})
  return out


def update_router_bias(bias_LE: jax.Array, load_LE: jax.Array, rate: float) -> jax.Array:
  """Aux-loss-free balancing (DeepSeek-V3): raise the selection bias of under-loaded experts and
  lower it for over-loaded ones by `rate`, outside the gradient."""
  mean_L1 = jnp.mean(load_LE, axis=1, keepdims=True)
  return bias_LE + (rate * jnp.sign(mean_L1 - load_LE)).astype(bias_LE.dtype)


def make_train_step(model_def: ModelDef, tx: optax.GradientTransformation, *, mesh: Mesh,
                    rules: Rules, grad_accum: int, z_loss_weight: float,
                    lr_schedule: optax.Schedule, moe_aux_loss_weight: float = 0.0,
                    router_bias_update_rate: float = 0.0, loss_chunk_length: int = 0) -> Callable:
  def micro_loss(params, micro):
    nll, z, n, sown = token_loss_sums(model_def, params, micro, z_loss_weight=z_loss_weight,
                                      chunk=loss_chunk_length)
    moe = moe_terms(sown["moe_stats"], moe_aux_loss_weight) if "moe_stats" in sown else {}
    if moe:
      nll = nll + moe["weighted"]
    return nll, (z, n, moe)

  grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

  def step(state: TrainState, batch: dict[str, jax.Array]):
    with use_rules(mesh, rules):
      params = state["params"]
      if grad_accum == 1:
        (nll, (z, n, moe)), grads = grad_fn(params, batch)
      else:
        # micro-batch j = rows j, j+A, j+2A, …: every device's contiguous block of rows holds an
        # equal share of each micro-batch, so no rows move between devices
        micro_batches = jax.tree.map(
            lambda x: x.reshape(x.shape[0] // grad_accum, grad_accum, *x.shape[1:]).swapaxes(0, 1),
            batch)

        def accumulate(carry, micro):
          micro = jax.tree.map(lambda x: constrain(x, BATCH_AXES), micro)
          (l, (zz, nn, mm)), g = grad_fn(params, micro)
          acc_g, acc_l, acc_z, acc_n, acc_m = carry
          return (jax.tree.map(jnp.add, acc_g, g), acc_l + l, acc_z + zz, acc_n + nn,
                  jax.tree.map(jnp.add, acc_m, mm)), None

        f32_zero = jnp.zeros((), jnp.float32)
        first = jax.tree.map(lambda x: x[0], micro_batches)
        moe_zero = jax.tree.map(jnp.zeros_like, jax.eval_shape(grad_fn, params, first)[0][1][2])
        zero = (jax.tree.map(jnp.zeros_like, params), f32_zero, f32_zero, f32_zero, moe_zero)
        (grads, nll, z, n, moe), _ = jax.lax.scan(accumulate, zero, micro_batches)
      denom = jnp.maximum(n, 1.0)
      grads = jax.tree.map(lambda g: g / denom, grads)
      grad_norm = optax.tree.norm(grads)
      updates, opt_state = tx.update(grads, state["opt_state"], params)
      # a non-finite loss or gradient never reaches the parameters or the optimizer moments
      finite = jnp.isfinite(nll) & jnp.isfinite(grad_norm)
      keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
      new_params = optax.apply_updates(params, updates)
      if moe and router_bias_update_rate > 0:
        new_params = {**new_params, "router_bias": update_router_bias(
            new_params["router_bias"], moe["load"], router_bias_update_rate)}
      new_state = {"step": state["step"] + 1,
                   "params": keep(new_params, params),
                   "opt_state": keep(opt_state, state["opt_state"])}
      metrics = {"loss": nll / denom, "z_loss": z / denom, "tokens": n, "grad_norm": grad_norm,
                 "lr": lr_schedule(state["step"]), "finite": finite.astype(jnp.float32)}
      if moe:
        metrics.update(moe_metrics(moe["load"], moe["aux_loss_sum"] / denom, moe["dropped"]))
    return new_state, metrics

  return step


def batch_sharding(mesh: Mesh, rules: Rules, global_batch: int, seq_len: int) -> NamedSharding:
  return NamedSharding(mesh, logical_to_spec(BATCH_AXES, (global_batch, seq_len), rules, mesh))


def jit_train_step(step_fn: Callable, state_shardings: TrainState, batch_shard: NamedSharding,
                   mesh: Mesh):
  replicated = NamedSharding(mesh, PartitionSpec())   # every metric (a prefix of the dict)
  batch_shardings = {k: batch_shard for k in BATCH_KEYS}
  return jax.jit(step_fn, in_shardings=(state_shardings, batch_shardings),
                 out_shardings=(state_shardings, replicated), donate_argnums=(0,))
