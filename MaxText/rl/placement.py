"""Where GRPO's rollouts run (`rollout_placement`, one key):

  colocated  the decoding engine on the training mesh, sampling from the trainer's parameters as
             they are sharded for training: no second copy of the weights, no transfer.
  separate   the engine on devices of its own (the second half of the process's devices; the
             trainer has the first half), with its own copy of the weights: after each update the
             trainer's parameters are shipped to it by the refit stream (MaxText/refit.py: one
             Hugging Face tensor at a time, LoRA merged — what an inference engine such as vLLM
             loads), each tensor written into the engine's parameter on its shardings as it
             arrives (`refit.Receiver`: each engine device gets its slice; the model is never put
             together on the host), the engine's previous copy overwritten in place. The seconds
             this takes are a metric (`weight_shipping_s`).

Both sample with the same keys, so a seeded run draws the same completions either way when the
two meshes compute the same numbers (tests/test_rl_placement.py)."""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import jax

from MaxText import refit
from MaxText.config.load import ConfigError
from MaxText.config.schema import Config
from MaxText.decoding.engine import Engine
from MaxText.models.model_config import ModelConfig
from MaxText.models.registry import hf_model_type_for
from MaxText.sharding.mesh import create_mesh
from MaxText.sharding.rules import Rules
from MaxText.backend.device_type import Device

PLACEMENTS = ("colocated", "separate")


def split_devices(cfg: Config, devices: Sequence[Device]) -> tuple[list, list]:
  """(the trainer's devices, the engine's): all and the same for colocated; the two halves for
  separate (ConfigError when that cannot be)."""
  devices = list(devices)
  if cfg.rollout_placement == "colocated":
    return devices, devices
  if jax.process_count() > 1:
    raise ConfigError("rollout_placement=separate runs in one process (the engine on half of its "
                      "devices); with several processes use colocated")
  if len(devices) < 2 or len(devices) % 2:
    raise ConfigError(f"rollout_placement=separate splits the devices in two halves (trainer, "
                      f"engine); {len(devices)} devices do not")
  half = len(devices) // 2
  return devices[:half], devices[half:]


class Rollouts:
  """The engine of a run and the parameters it samples from (module docstring)."""

  def __init__(self, cfg: Config, mcfg: ModelConfig, train_mesh: Any, rules: Rules,
               engine_devices: Sequence[Device], *, batch_size: int, max_cache_length: int):
    self.cfg, self.separate = cfg, cfg.rollout_placement == "separate"
    if self.separate:
      mesh = create_mesh(cfg, list(engine_devices))
      self.mcfg = dataclasses.replace(mcfg, lora_rank=0)   # the stream's weights are merged
    else:
      mesh, self.mcfg = train_mesh, mcfg
    self.engine = Engine(self.mcfg, mesh, rules, cache_dtype=cfg.cache_dtype,
                         batch_size=batch_size, max_cache_length=max_cache_length)
    if self.separate:
      try:
        self.receiver = refit.Receiver(self.mcfg, self.engine.param_shardings,
                                       hf_model_type_for(mcfg, cfg.hf_model_type))
      except ValueError as e:
        raise ConfigError(f"rollout_placement=separate: {e}") from None
    self.shipping_s = 0.0   # of the last `params_for_engine`
    self._shipped: Any = None   # the engine's copy (separate), overwritten by the next shipment

  def params_for_engine(self, params: Any) -> Any:
    """What the engine samples from: `params` themselves (colocated), or their copy shipped by
    the refit stream onto the engine's devices (separate; `shipping_s` its seconds)."""
    if not self.separate:
      self.shipping_s = 0.0
      return params
    jax.block_until_ready(params)   # the update in flight is not shipping time
    t0 = time.perf_counter()
    self._shipped = self.receiver.load(refit.stream(params, self.cfg), self._shipped)
    jax.block_until_ready(self._shipped)
    self.shipping_s = time.perf_counter() - t0
    return self._shipped
