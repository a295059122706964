"""The Trainer's state source and sink (`train/loop.py: Trainer` holds one `CheckpointedState`): the
state a run starts from — its latest checkpoint, the parameters of `load_parameters_path` (a whole model,
a base for fresh LoRA adapters, or a LoRA checkpoint and its base), or a fresh init — and what a
checkpoint saves of it (a LoRA run: the adapters and the reference to its base,
resolve/lora_base.py). `Checkpointing` is what the step loop (train/step_loop.py) saves through:
the run's checkpoints, the state's saved part and the data iterator's position."""
from __future__ import annotations

import concurrent.futures
from typing import Any, Callable

import jax

from MaxText.checkpoint.manager import RunCheckpoints, load_params, read_meta
from MaxText.config.schema import Config
from MaxText.layers import lora
from MaxText.models.model_config import ModelConfig
from MaxText.models.registry import get_hf_map
from MaxText.resolve import hf_sharded, lora_base
from MaxText.train.optimizer import Optimizer
from MaxText.train.run_log import log, log_host
from MaxText.train.state import init_state


class CheckpointedState:
  """The state a run starts from and what its checkpoints hold of it (module docstring), for the
  model of `abstract` (the abstract train state) and its optimizer `tx`. `lora_base`: the base a
  LoRA run's checkpoints refer to (set by `initial_state`)."""

  def __init__(self, cfg: Config, mcfg: ModelConfig, abstract: dict, shardings: dict,
               tx: Optimizer, adapters_only: bool):
    self.cfg, self.mcfg, self.abstract, self.shardings = cfg, mcfg, abstract, shardings
    self.tx, self.adapters_only = tx, adapters_only
    self.lora_base: dict | None = None

  def initial_state(self, ckpts: RunCheckpoints | None, data_iter: Any,
                    meanwhile: Callable[[], Any] | None = None) -> tuple[dict, int]:
    """The state to start from: the run's latest checkpoint (`meanwhile()` runs while its arrays
    are verified), the parameters of `load_parameters_path`, those of `hf_path` (read onto the
    mesh, each process its own slices: resolve/hf_sharded.py), or a fresh init (on an accelerator
    `meanwhile()` runs while the init program compiles and runs)."""
    cfg = self.cfg
    latest = ckpts.latest_step() if ckpts is not None else None
    if ckpts is not None and latest is not None:
      # a LoRA run's checkpoints hold the adapters and a reference to the base (resolve/lora_base.py)
      ref = lora_base.checkpoint_reference(ckpts.step_dir(latest)) \
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
    elif cfg.hf_path:
      params, stats = hf_sharded.load_sharded(cfg.hf_path, get_hf_map(cfg.hf_model_type),
                                              self.mcfg, self.abstract["params"])
      log_host(f"read {stats.bytes} bytes of {cfg.hf_path} in {stats.reads} ranged reads "
               f"(headers: {stats.header_bytes} bytes), this process's slices only")
      log(f"loaded parameters from hf_path={cfg.hf_path}")
    if meanwhile is not None and jax.default_backend() != "cpu":
      # on an accelerator, the init program's compile (and run) and `meanwhile()` (the train
      # step's compile) overlap: XLA compiles on host threads, so the init runs on a worker
      # thread beside this one (on a CPU both would take the same cores: one after the other)
      with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="init") as pool:
        initialised = pool.submit(init_state, self.mcfg, cfg.seed, self.tx, self.shardings,
                                  params)
        meanwhile()
        state = initialised.result()
    else:
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


class Checkpointing:
  """The step loop's checkpoints (`step_loop.Checkpoints`): `save(step, state)` writes what
  `holder` keeps of the state (None: the whole state) with `data_iter`'s position (None: no data
  item, e.g. GRPO's prompts chosen per step) and `config_dict`."""

  def __init__(self, ckpts: RunCheckpoints, config_dict: dict, data_iter: Any = None,
               holder: CheckpointedState | None = None):
    self.ckpts, self.config_dict, self.data_iter, self.holder = ckpts, config_dict, data_iter, holder

  def save(self, step: int, state: dict) -> None:
    if self.holder is None:
      self.ckpts.save(step, state, self.data_iter, self.config_dict)
    else:
      self.holder.save_checkpoint(self.ckpts, step, state, self.data_iter, self.config_dict)

  def check(self) -> None:
    self.ckpts.check()

  def wait(self) -> None:
    self.ckpts.wait()
