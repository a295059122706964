"""A model's static half and its parameters' shapes, built from a family's constructor: the NNX
graphdef, the abstract parameters (ShapeDtypeStruct, nothing allocated) and their logical axes.
Parameters are plain nested dicts (`nnx.to_pure_dict`). `registry.make_model_def(mcfg)` /
`registry.init_params(mcfg, seed)` pick the constructor from `mcfg.decoder_block`. Its calls trace
the model on `mcfg.hot_path` (MaxText/backend/hot_path.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
from flax import nnx, traverse_util

from MaxText.backend import hot_path
from MaxText.layers import lora, quant
from MaxText.models.model_config import ModelConfig

Build = Callable[..., nnx.Module]   # build(mcfg, rngs=nnx.Rngs(...))


@dataclass(frozen=True)
class ModelDef:
  """The static half of a model (NNX graphdef) plus the abstract parameters and their logical axes."""
  graphdef: Any
  abstract_params: Any   # pure dict of ShapeDtypeStruct
  logical_axes: Any      # pure dict of tuples of logical names
  hot_path: str = "auto"   # the layers' path when traced (`ModelConfig.hot_path`)

  def apply(self, params, *args):
    return self.apply_with_aux(params, *args)[0]

  def apply_with_aux(self, params, *args):
    """(logits, auxiliary outputs, e.g. {"moe_stats": …}): the family's `forward_with_aux`."""
    with hot_path.use(self.hot_path):
      return nnx.merge(self.graphdef, params).forward_with_aux(*args)

  def apply_hidden(self, params, *args):
    """(final-norm hidden state [B, S, D], auxiliary outputs): for a loss that applies the head
    (`head`) chunk by chunk (`losses/loss.py`); the family's `forward_with_aux(return_hidden=True)`."""
    with hot_path.use(self.hot_path):
      return nnx.merge(self.graphdef, params).forward_with_aux(*args, return_hidden=True)

  def head(self, params, hidden):
    """The family's LM head: final-norm hidden states [..., D] → fp32 logits [..., V]."""
    with hot_path.use(self.hot_path):
      return nnx.merge(self.graphdef, params).logits(hidden)


def _build(build: Build, mcfg: ModelConfig, seed: int,
           modify: Callable[[nnx.Module], Any] | None = None) -> nnx.Module:
  """The family's module; with `lora_rank`, its projections carry adapters (layers/lora.py); with
  `quantization` / `weight_bits`, quantized matmuls (layers/quant.py); then `modify(model)`."""
  with nnx.use_eager_sharding(False):
    rngs = nnx.Rngs(params=seed)
    model = build(mcfg, rngs=rngs)
    if mcfg.lora_rank:
      lora.attach(model, mcfg.lora_rank, mcfg.lora_alpha, mcfg.lora_targets, rngs)
    quant.apply(model, mcfg)
    if modify is not None:
      modify(model)
    return model


def model_def_of(build: Build, mcfg: ModelConfig,
                 modify: Callable[[nnx.Module], Any] | None = None) -> ModelDef:
  """`modify(model)`, when given, changes the built module before it is split (e.g. calibration
  probes)."""
  abstract_model = nnx.eval_shape(lambda: _build(build, mcfg, 0, modify))
  graphdef, state = nnx.split(abstract_model)
  shapes, axes = {}, {}
  for path, var in nnx.to_flat_state(state):
    value = var.get_value()
    shapes[path] = jax.ShapeDtypeStruct(value.shape, value.dtype)
    axes[path] = tuple(var.get_metadata().get("logical_axes") or (None,) * len(value.shape))
  return ModelDef(graphdef, traverse_util.unflatten_dict(shapes), traverse_util.unflatten_dict(axes),
                  mcfg.hot_path)


def init_params_of(build: Build, mcfg: ModelConfig, seed: int):
  return nnx.to_pure_dict(nnx.state(_build(build, mcfg, seed)))
