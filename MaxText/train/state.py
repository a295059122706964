"""The train state — `{"step", "params", "opt_state"}`, all plain pytrees of arrays — its shardings,
and its sharded initialisation (parameters are created directly in their shards under jit)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, traverse_util
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from MaxText.models.model_config import ModelConfig
from MaxText.models.registry import get_family
from MaxText.sharding.rules import Rules, tree_shardings

TrainState = dict[str, Any]


@dataclass(frozen=True)
class ModelDef:
  """The static half of a model (NNX graphdef) plus the abstract parameters and their logical axes."""
  graphdef: Any
  abstract_params: Any   # pure dict of ShapeDtypeStruct
  logical_axes: Any      # pure dict of tuples of logical names

  def apply(self, params, *args):
    return self.apply_with_aux(params, *args)[0]

  def apply_with_aux(self, params, *args):
    """(logits, auxiliary outputs, e.g. {"moe_stats": …}); a family's `forward_with_aux`."""
    return nnx.merge(self.graphdef, params).forward_with_aux(*args)

  def apply_hidden(self, params, *args):
    """(final-norm hidden state [B, S, D], auxiliary outputs): for a loss that applies the head
    (`head`) chunk by chunk (`train/loss.py`)."""
    return nnx.merge(self.graphdef, params).forward_with_aux(*args, return_hidden=True)

  def head(self, params, hidden):
    """The family's LM head: final-norm hidden states [..., D] → fp32 logits [..., V]."""
    return nnx.merge(self.graphdef, params).logits(hidden)


def _build(mcfg: ModelConfig, seed: int) -> nnx.Module:
  with nnx.use_eager_sharding(False):
    return get_family(mcfg.decoder_block).build(mcfg, nnx.Rngs(params=seed))


def make_model_def(mcfg: ModelConfig) -> ModelDef:
  abstract_model = nnx.eval_shape(lambda: _build(mcfg, 0))
  graphdef, state = nnx.split(abstract_model)
  shapes, axes = {}, {}
  for path, var in nnx.to_flat_state(state):
    value = var.get_value()
    shapes[path] = jax.ShapeDtypeStruct(value.shape, value.dtype)
    axes[path] = tuple(var.get_metadata().get("logical_axes") or (None,) * len(value.shape))
  return ModelDef(graphdef, traverse_util.unflatten_dict(shapes), traverse_util.unflatten_dict(axes))


def init_params(mcfg: ModelConfig, seed: int):
  return nnx.to_pure_dict(nnx.state(_build(mcfg, seed)))


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
