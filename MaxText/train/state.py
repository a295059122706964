"""The train state — `{"step", "params", "opt_state"}`, all plain pytrees of arrays — its shardings,
and its sharded initialisation (parameters are created directly in their shards under jit; a small
model's on a CPU by its one init program, then placed)."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from MaxText.layers import lora
from MaxText.models.model_config import ModelConfig
from MaxText.models.model_def import ModelDef, with_init_options
from MaxText.models.registry import init_options, init_params, init_params_traced
from MaxText.sharding.rules import Rules, tree_shardings
from MaxText.sharding.zero import data_axes, optimizer_shardings
from MaxText.train.optimizer import Optimizer

TrainState = dict[str, Any]


def trained(params: Any, adapters_only: bool) -> Any:
  """The part of `params` the optimizer updates: all, or the LoRA adapters (layers/lora.py)."""
  return lora.split(params)[0] if adapters_only else params


def mesh_data_axes(model_def: ModelDef, mesh: Mesh, rules: Rules) -> tuple[str, ...]:
  """The mesh axes of size > 1 the batch is split over and no parameter is (sharding/zero.py)."""
  return data_axes(mesh, rules, tree_shardings(model_def.logical_axes, model_def.abstract_params,
                                               mesh, rules))


def state_shardings(model_def: ModelDef, tx: Optimizer, mesh: Mesh,
                    rules: Rules, adapters_only: bool = False) -> TrainState:
  replicated = NamedSharding(mesh, PartitionSpec())
  params = tree_shardings(model_def.logical_axes, model_def.abstract_params, mesh, rules)
  abstract_opt = jax.eval_shape(tx.init, trained(model_def.abstract_params, adapters_only))
  moments = trained(params, adapters_only)
  if tx.shard_over_data:   # ZeRO-1: the moments split over the data axes too
    moments = optimizer_shardings(moments, trained(model_def.abstract_params, adapters_only),
                                  trained(model_def.logical_axes, adapters_only), tx.data_axes)
  opt = optax.tree_map_params(tx, lambda _, sh: sh, abstract_opt, moments,
                              transform_non_params=lambda _: replicated)
  return {"step": replicated, "params": params, "opt_state": opt}


def abstract_state(model_def: ModelDef, tx: Optimizer, shardings: TrainState,
                   adapters_only: bool = False):
  shapes = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": model_def.abstract_params,
            "opt_state": jax.eval_shape(tx.init, trained(model_def.abstract_params,
                                                         adapters_only))}
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      shapes, shardings)


def platform_of(shardings: Any) -> str:
  """The platform of the devices a tree of shardings places its arrays on."""
  return next(iter(jax.tree.leaves(shardings)[0].device_set)).platform


def init_state(mcfg: ModelConfig, seed: int, tx: Optimizer,
               shardings: TrainState, params: Any = None) -> TrainState:
  """Fresh state on the mesh (a small model's parameters on a CPU: `init_params`' program, then
  placed; else created in place: `fresh_program`). `params` (already placed) skips the random
  init; with `lora_rank` and no adapters among them they are the base's, and the adapters are
  initialised (the base's init is not computed: only the adapters of the traced init are used)."""
  adapters_only = bool(mcfg.lora_rank)
  platform = platform_of(shardings)
  options = init_options(mcfg, platform)   # the values `init_params` alone gives there
  if params is None and platform == "cpu" and options is not None and jax.process_count() == 1:
    # A small model on a CPU (`init_options`): `init_params`' one program per model, whatever the
    # mesh, then placed in its shards. The same values as initialising in place, and a run on
    # another mesh, or of the same model again in this process, does not compile (or trace) the
    # random init again: it runs on the platform's lowest-numbered local device whichever devices
    # the mesh holds (a CPU's devices share the host's memory, and a program compiled for another
    # device is another program: compiled again, under another persistent-cache key). A large
    # model, an accelerator, or several processes initialise in place. (through the host: a
    # device-to-device reshard compiles a slicing program per array)
    with jax.default_device(min(jax.local_devices(backend=platform), key=lambda d: d.id)):
      host = jax.device_get(init_params(mcfg, seed))
    params = jax.device_put(host, shardings["params"])
  if params is None:
    return with_init_options(lambda o: fresh_program(mcfg, seed, tx, shardings, o), options)

  def make(params):
    if adapters_only and not lora.split(params)[0]:   # a base without adapters
      params = lora.join(lora.split(init_params_traced(mcfg, seed))[0], params)
    return {"step": jnp.zeros((), jnp.int32), "params": params,
            "opt_state": tx.init(trained(params, adapters_only))}
  return with_init_options(lambda o: jax.jit(make, out_shardings=shardings, compiler_options=o),
                           options, params)


def fresh_program(mcfg: ModelConfig, seed: int, tx: Optimizer, shardings: TrainState,
                  options: dict[str, Any] | None):
  """The jitted program (not yet called) with which `init_state` creates a fresh state in place:
  the parameters, the step and the optimizer state, one program compiled with `options` (the
  init's for the shardings' platform: `init_options(mcfg, platform_of(shardings))`;
  benchmarks/tpu_init.py --aot compiles it for a TPU without one)."""
  adapters_only = bool(mcfg.lora_rank)

  def fresh():   # named: compile logs show "fresh", not "<lambda>"
    params = init_params_traced(mcfg, seed)
    return {"step": jnp.zeros((), jnp.int32), "params": params,
            "opt_state": tx.init(trained(params, adapters_only))}
  return jax.jit(fresh, out_shardings=shardings, compiler_options=options)
