"""The Trainer's state source and sink (`train/loop.py: Trainer` is a `CheckpointedState`): the state
a run starts from — its latest checkpoint, the parameters of `load_parameters_path` (a whole model,
a base for fresh LoRA adapters, or a LoRA checkpoint and its base), or a fresh init — and what a
checkpoint saves of it (a LoRA run: the adapters and the reference to its base,
resolve/lora_base.py). Uses the Trainer's `cfg`, `mcfg`, `abstract`, `adapters_only`, `tx`,
`shardings` and sets its `lora_base`."""
from __future__ import annotations

from typing import Any, Callable

from MaxText.checkpoint.manager import RunCheckpoints, load_params, read_meta
from MaxText.layers import lora
from MaxText.resolve import lora_base
from MaxText.train.run_log import log
from MaxText.train.state import init_state


class CheckpointedState:
  """The state part of `Trainer` (module docstring)."""

  def initial_state(self, ckpts: RunCheckpoints | None, data_iter: Any,
                    meanwhile: Callable[[], Any] | None = None) -> tuple[dict, int]:
    """The state to start from: the run's latest checkpoint (`meanwhile()` runs while its arrays
    are verified), the parameters of `load_parameters_path`, or a fresh init."""
    cfg = self.cfg
    if ckpts is not None and ckpts.latest_step() is not None:
      # a LoRA run's checkpoints hold the adapters and a reference to the base (resolve/lora_base.py)
      ref = lora_base.checkpoint_reference(ckpts.step_dir(ckpts.latest_step())) \
          if self.adapters_only else None
      state, start = ckpts.restore_latest(self.saved_part(self.abstract, ref), data_iter,
                                          verify=cfg.checkpoint_verify,
                                          fallback=cfg.checkpoint_fallback, log=log,
                                          meanwhile=meanwhile)
      if state is not None:
        if ref is not None:
          state["params"] = lora.join(state["params"], lora_base.base_of(
              ref, self.mcfg, lora.split(self.abstract["params"])[1], verify=cfg.checkpoint_verify,
              source=ckpts.step_dir(start)))
        self.lora_base = ref
        log(f"resumed from {ckpts.directory}/{start}")
        return state, start
    params = None
    if cfg.load_parameters_path:
      path = cfg.load_parameters_path
      has_adapters = read_meta(path)["config"].get("lora_rank", 0) > 0
      ref = lora_base.checkpoint_reference(path)
      if self.adapters_only and not has_adapters:
        # LoRA from a checkpoint without adapters: its parameters are the base (adapters start
        # fresh), and it is the base the run's checkpoints refer to
        params = load_params(path, lora.split(self.abstract["params"])[1],
                             verify=cfg.checkpoint_verify)
        self.lora_base = lora_base.reference(path, cfg.seed, params)
      elif self.adapters_only and ref is not None:
        # a LoRA checkpoint (adapters + base reference): the run keeps adapting that base
        params = lora_base.load(path, self.mcfg, self.abstract["params"],
                                verify=cfg.checkpoint_verify)
        self.lora_base = ref
      else:   # a whole model (or a LoRA checkpoint of the former format, which holds its base)
        params = load_params(path, self.abstract["params"], verify=cfg.checkpoint_verify)
      log(f"loaded parameters from {path}")
    state = init_state(self.mcfg, cfg.seed, self.tx, self.shardings, params)
    if self.adapters_only and not cfg.load_parameters_path:
      self.lora_base = lora_base.reference("", cfg.seed, lora.split(state["params"])[1])
    return state, 0

  def saved_part(self, state: dict, ref: dict | None) -> dict:
    """What a checkpoint holds of `state` (or its abstract): with a LoRA base reference, the
    params are the adapters only."""
    if ref is None:
      return state
    return {**state, "params": lora.split(state["params"])[0]}

  def save_checkpoint(self, ckpts: RunCheckpoints, step: int, state: dict, data_iter: Any,
                      config_dict: dict) -> None:
    """Saves `state` at `step` (a LoRA run: its adapters and the reference to its base)."""
    ckpts.save(step, self.saved_part(state, self.lora_base), data_iter, config_dict,
               meta=None if self.lora_base is None else {lora_base.META_KEY: self.lora_base})
