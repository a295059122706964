"""The train state — `{"step", "params", "opt_state"}`, all plain pytrees of arrays — its shardings,
and its sharded initialisation (parameters are created directly in their shards under jit)."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from MaxText.models.model_config import ModelConfig
from MaxText.models.model_def import ModelDef
from MaxText.models.registry import init_params
from MaxText.sharding.rules import Rules, tree_shardings

TrainState = dict[str, Any]


def state_shardings(model_def: ModelDef, tx: optax.GradientTransformation, mesh: Mesh,
                    rules: Rules) -> TrainState:
  replicated = NamedSharding(mesh, PartitionSpec())
  params = tree_shardings(model_def.logical_axes, model_def.abstract_params, mesh, rules)
  abstract_opt = jax.eval_shape(tx.init, model_def.abstract_params)
  opt = optax.tree_map_params(tx, lambda _, sh: sh, abstract_opt, params,
                              transform_non_params=lambda _: replicated)
  return {"step": replicated, "params": params, "opt_state": opt}


def abstract_state(model_def: ModelDef, tx: optax.GradientTransformation, shardings: TrainState):
  shapes = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": model_def.abstract_params,
            "opt_state": jax.eval_shape(tx.init, model_def.abstract_params)}
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      shapes, shardings)


def init_state(mcfg: ModelConfig, seed: int, tx: optax.GradientTransformation,
               shardings: TrainState, params: Any = None) -> TrainState:
  """Fresh state, created in place on the mesh. `params` (already placed) skips the random init."""
  def make(params):
    if params is None:
      params = init_params(mcfg, seed)
    return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}

  if params is None:
    return jax.jit(lambda: make(None), out_shardings=shardings)()
  return jax.jit(make, out_shardings=shardings)(params)
