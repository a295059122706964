"""The training run: config → mesh → model/optimizer state (fresh, resumed or fine-tuned) → data →
compiled step → loop with metrics and checkpoints. `main(argv)` returns the process exit status
(`exit_codes.py`: 0 done, 2 config, 3 data, 4 checkpoint, 5 non-finite, 42 preempted and saved)."""
from __future__ import annotations

import copy
import dataclasses
import os
import re
import socket
import time
from typing import Any, Sequence

import jax
import numpy as np

from MaxText.backend import hot_path
from MaxText.checkpoint import data_state
from MaxText.checkpoint.errors import CheckpointError
from MaxText.checkpoint.manager import RunCheckpoints
from MaxText.config.load import ConfigError, load_config, models_dir, to_yaml
from MaxText.config.schema import ARCHITECTURE_KEYS, AUTO, Config
from MaxText.data.batch import BATCH_KEYS, row_specs
from MaxText.data.config import DataConfig
from MaxText.data.errors import BadRecordsError, DataError
from MaxText.data.pipeline import make_shard_iterator, media_slots, validate_data_config
from MaxText.data.tokenizers import Tokenizer
from MaxText.layers import stack
from MaxText.layers.pipeline import schedule_of as pipeline_schedule
from MaxText.losses.mtp import with_mtp
from MaxText.metrics.peaks import device_peak_tflops
from MaxText.metrics.writers import MetricsWriter
from MaxText.models.model_config import ModelConfig
from MaxText.models.registry import get_family, make_model_def, training_flops
from MaxText.resolve import auto_settings
from MaxText.resolve.config_checks import check_config
from MaxText.resolve.architecture import adopt_architecture
from MaxText.resolve.from_hf import check_tensors
from MaxText.resolve.tokenizer_setup import choose_tokenizer
from MaxText.runtime import compile_cache, cpu_devices, distributed, faults
from MaxText.runtime.exit_codes import (EXIT_CHECKPOINT, EXIT_CONFIG, EXIT_DATA,
                                        EXIT_INTERRUPTED, EXIT_NONFINITE, EXIT_OK, EXIT_PREEMPTED)
from MaxText.runtime.host_data import data_layout, process_rows
from MaxText.runtime.preemption import PreemptionWatch, StopNow
from MaxText.runtime.run_dir import RunLock, keep_created, remove_created, run_dir_of
from MaxText.runtime.startup import StartupClock
from MaxText.sharding.mesh import create_mesh
from MaxText.sharding.rules import batch_sharding, parse_rules, rows_like, sharding_report
from MaxText.storage import paths
from MaxText.train import memory, memory_plan
from MaxText.train.optimizer import learning_rate_schedule, make_optimizer
from MaxText.train.periodic import Periodic
from MaxText.train.run_log import log, log_error, log_host
from MaxText.train.state import abstract_state, mesh_data_axes, state_shardings, trained
from MaxText.train.step import jit_train_step, make_train_step
from MaxText.metrics.profiler import StepProfiler
from MaxText.train.step_loop import LoopParts, Schedule, StepLoop, superseded_note
from MaxText.train.step_rows import StepProgress, StepRows
from MaxText.train.trainer_state import Checkpointing, CheckpointedState
from MaxText.backend.device_type import Device

__all__ = ["EXIT_CHECKPOINT", "EXIT_CONFIG", "EXIT_DATA", "EXIT_NONFINITE", "EXIT_OK",
           "EXIT_PREEMPTED", "Trainer", "main", "run"]


def setup_jax(cfg: Config) -> str:
  """The persistent compilation cache (runtime/compile_cache.py); returns the line naming it."""
  return compile_cache.use(cfg.jax_cache_dir)


class Trainer:
  """One training run on `devices` (default: all). After `run()`, `final_state` holds the state.
  Its parts: the state it starts from and what a checkpoint saves of it (`checkpointed`,
  train/trainer_state.py), and the one loop over steps (train/step_loop.py) that its step function
  and data (`prepare`, `loop_parts`; a trainer of other batches replaces those two, e.g.
  MaxText/rl/grpo.py) plug into.
  `tokenizer`: what `check_config` returned (None: the data config is checked when the run starts).
  `cfg` may hold auto values (dtype=auto, loss_chunk_length=-1), or be `run()`'s one resolution
  of them (`auto_settings.for_training`): `self.training` is that resolution, `self.cfg` its
  concrete config. `tool`: the name under which the schema says which keys it reads
  (MaxText/config/tools.py); `run()` refuses any other key set away from its default."""

  tool = "train"
  # the variant the memory estimate counts (`estimate_with`: remat_policy, loss_chunk, batch)
  planning: dict = {}

  def __init__(self, cfg: Config | auto_settings.Training,
               devices: Sequence[Device] | None = None, tokenizer: Tokenizer | None = None):
    self.training = auto_settings.for_training(cfg)
    self.cfg = cfg = self.training.cfg
    self.data_config = DataConfig.from_config(cfg)
    self.tokenizer = tokenizer
    self.devices = list(jax.devices() if devices is None else devices)
    self.run_dir = run_dir_of(cfg)
    self.mesh = create_mesh(cfg, self.devices)
    self.final_state = None
    self.rules = parse_rules(cfg.logical_axis_rules, cfg.mesh_axes)
    self.mcfg = ModelConfig.from_config(cfg)
    self.family = get_family(self.mcfg.decoder_block)
    self.aux_terms = with_mtp(self.family.aux_terms(self.mcfg), self.mcfg.mtp_loss_scale,
                              self.mcfg.mtp_num_layers)   # None: cross-entropy (+ z-loss) only
    self.adapters_only = bool(cfg.lora_rank)   # LoRA: only the adapters are trained
    self.model_def, self.tx, self.shardings, self.abstract = self._state_of(cfg, self.mcfg)
    self.lr_schedule = learning_rate_schedule(cfg)
    self.checkpointed = CheckpointedState(cfg, self.mcfg, self.abstract, self.shardings, self.tx,
                                          self.adapters_only)
    n = len(self.devices)
    self.global_batch = cfg.global_batch_size(n)
    self.schedule = pipeline_schedule(cfg, dict(self.mesh.shape))
    self.batch_sharding = batch_sharding(self.mesh, self.rules, self.global_batch,
                                         cfg.max_target_length)
    # every key of a row (the token arrays; SFT with images / audio: their slots) and its sharding
    self.row_specs = row_specs(cfg.max_target_length, self._media_specs())
    self.batch_shardings = {k: self.batch_sharding if k in BATCH_KEYS else
                            rows_like(self.batch_sharding, len(shape) + 1)
                            for k, (shape, _) in self.row_specs.items()}
    # the rows of each global batch this process feeds (its devices' part of the batch sharding)
    self.rows = process_rows(self.batch_sharding, (self.global_batch, cfg.max_target_length))
    self.distributed: distributed.Plan | None = None  # set by run(): how the processes joined
    self.cpu_defaults: cpu_devices.Defaults | None = None  # set by run(): CPU devices, schedule
    # set by run(): the holder of a stale run lock this run took over (a run that died)
    self.dead_previous_run: dict | None = None
    self.clock = StartupClock(from_process_start=False)  # run() sets the one from the command
    if cfg.remat_policy == AUTO:
      self._resolve_remat()

  def _resolve_remat(self) -> None:
    """remat_policy=auto: the fastest policy whose estimate (this state + that policy's
    activations; train/memory_plan.py) fits; the model rebuilt with it (nothing else depends on
    the policy), the reason kept for the start-up line."""
    policy, why = memory_plan.pick_remat(
        lambda **planning: self.estimate_with(own=False, **planning), self.cfg.decoder_block)
    self._use_remat(policy, why)

  def _use_remat(self, policy: str, why: str) -> None:
    """The model rebuilt with remat `policy` (nothing else depends on it), `why` for the
    start-up line."""
    self.training = dataclasses.replace(
        self.training, cfg=dataclasses.replace(self.cfg, remat_policy=policy),
        auto=self.training.auto | {"remat_policy"}, remat_note=why)
    self.cfg = self.training.cfg
    self.mcfg = ModelConfig.from_config(self.cfg)
    self.model_def = make_model_def(self.mcfg)
    self.checkpointed = CheckpointedState(self.cfg, self.mcfg, self.abstract, self.shardings,
                                          self.tx, self.adapters_only)

  def _lighter_remat(self, error: BaseException) -> bool:
    """remat_policy=auto whose choice XLA refused to compile for memory (the estimate under
    XLA's count): the next lighter policy (`memory_plan.policies_of`), the model rebuilt with it,
    the refusal kept in the start-up line's note. False when the policy was the user's, or when
    it was the lightest."""
    if "remat_policy" not in self.training.auto:
      return False
    policies = memory_plan.policies_of(self.cfg.decoder_block)
    refused = self.cfg.remat_policy
    if refused not in policies or refused == policies[-1]:
      return False
    policy = policies[policies.index(refused) + 1]
    figure = memory.xla_memory_figure(error)
    said = f" ({figure})" if figure else ""
    log(f"remat_policy=auto: XLA refused {refused}{said}; compiling with {policy}")
    self._use_remat(policy, f"remat_policy=auto: {policy}, the next lighter: XLA refused {refused}"
                            f"{said}, which the pre-flight estimated to fit")
    return True

  def _state_of(self, cfg: Config, mcfg: ModelConfig) -> tuple[Any, Any, dict, dict]:
    """(model definition, optimizer, the state's shardings, the abstract state) of `cfg` on this
    run's mesh: the dtypes the run holds (weight_dtype; the moments' moment_dtype)."""
    try:
      model_def = make_model_def(mcfg)
    except (ValueError, re.error) as e:   # lora_targets selects nothing / is no regex
      if not cfg.lora_rank:
        raise
      raise ConfigError(f"lora_targets={cfg.lora_targets!r}: {e}") from e
    tx = make_optimizer(cfg, trained(model_def.logical_axes, self.adapters_only),
                        self.family.frozen(mcfg), mesh_data_axes(model_def, self.mesh, self.rules))
    shardings = state_shardings(model_def, tx, self.mesh, self.rules, self.adapters_only)
    return model_def, tx, shardings, abstract_state(model_def, tx, shardings, self.adapters_only)

  def with_weight_dtype(self, weight_dtype: str) -> "Trainer":
    """This run, for the memory pre-flight only, with its weights in `weight_dtype`: a shallow
    copy whose model and abstract state are built as such a run builds them (so the moments
    follow moment_dtype and the estimate counts the dtypes it would hold); nothing compiled."""
    other = copy.copy(self)
    other.cfg = dataclasses.replace(self.cfg, weight_dtype=weight_dtype)
    other.mcfg = ModelConfig.from_config(other.cfg)
    other.model_def, other.tx, other.shardings, other.abstract = \
        self._state_of(other.cfg, other.mcfg)
    return other

  def _media_specs(self) -> dict:
    """The SFT rows' media slots (data/media_rows.py) for a model whose towers take them;
    ConfigError naming the key for media the model has no tower for."""
    dcfg = self.data_config
    if not dcfg.sft or not (dcfg.max_num_images_per_example or dcfg.max_num_audio_per_example):
      return {}
    takes = self.family.media(self.mcfg)
    for key, modality in (("max_num_images_per_example", "image"),
                          ("max_num_audio_per_example", "audio")):
      if getattr(dcfg, key) and modality not in takes:
        raise ConfigError(f"{key}={getattr(dcfg, key)}: model {self.cfg.model_name} has no "
                          f"{'vision' if modality == 'image' else 'audio'} tower")
    tokenizer = self.tokenizer or validate_data_config(dcfg)
    slots = media_slots(dcfg, tokenizer)
    return slots.specs() if slots is not None else {}

  def trained_params(self) -> Any:
    """The abstract parameters that get gradients and optimizer state (LoRA: the adapters)."""
    return trained(self.abstract["params"], self.adapters_only)

  def compile_step(self):
    return self.lower_step().compile(
        compiler_options=cpu_devices.step_compiler_options(self.devices[0].platform,
                                                           self.cfg.hot_path))

  def lower_step(self):
    """The train step lowered for the abstract state and batch (traced: the model at its
    matmul precision, `ModelDef.traced`), not yet compiled."""
    step_fn = make_train_step(self.model_def, self.tx, mesh=self.mesh, rules=self.rules,
                              grad_accum=self.cfg.gradient_accumulation_steps,
                              z_loss_weight=self.cfg.z_loss_weight, lr_schedule=self.lr_schedule,
                              aux_terms=self.aux_terms,
                              loss_chunk_length=self.cfg.loss_chunk_length,
                              adapters_only=self.adapters_only, schedule=self.schedule)
    jitted = jit_train_step(step_fn, self.shardings, self.batch_shardings, self.mesh)
    abstract_batch = {k: jax.ShapeDtypeStruct((self.global_batch, *shape), dtype,
                                              sharding=self.batch_shardings[k])
                      for k, (shape, dtype) in self.row_specs.items()}
    return jitted.lower(self.abstract, abstract_batch)

  def micro_batches(self) -> int:
    """Micro-batches of a step (their activations live one at a time)."""
    return self.cfg.gradient_accumulation_steps

  def rows_per_device(self) -> int:
    """Sequences of each global batch one device holds (its block of the batch sharding)."""
    return self.batch_sharding.shard_shape((self.global_batch, self.cfg.max_target_length))[0]

  def activation_bytes(self, remat_policy: str | None = None, loss_chunk: int | None = None,
                       batch: float | None = None) -> int:
    """The memory pre-flight's estimate of one micro-batch step's activations per device, plus
    what the family keeps beyond a generic decoder layer (e.g. recurrent states); of this run or
    of its variant with another remat policy, loss chunk or per_device_batch_size."""
    mcfg = self.mcfg if remat_policy is None else dataclasses.replace(self.mcfg,
                                                                      remat_policy=remat_policy)
    rows = self.rows_per_device() / self.micro_batches()
    if batch is not None:
      rows = rows * batch / self.cfg.per_device_batch_size
    return (memory.activation_bytes(
        mcfg, rows=rows, seq=self.cfg.max_target_length,
        loss_chunk=self.cfg.loss_chunk_length if loss_chunk is None else loss_chunk,
        schedule=self.schedule, param_bytes=memory.per_device_bytes(self.abstract["params"]),
        layer_param_bytes=memory.per_device_bytes(self.abstract["params"].get("decoder", {})))
            + self.family.activation_bytes(mcfg, rows, self.cfg.max_target_length))

  def memory_estimate(self) -> memory.MemoryEstimate:
    return memory.estimate(self.abstract, self.devices, self.activation_bytes(**self.planning),
                           self.trained_params())

  def estimate_with(self, own: bool = True, **planning) -> memory.MemoryEstimate:
    """The estimate of this run's variant `planning` (activation_bytes' keywords); `own`: with
    what this trainer adds (its `memory_estimate`: a reference copy, a decoding cache), else
    train.py's."""
    other = copy.copy(self)
    other.planning = planning
    return other.memory_estimate() if own else Trainer.memory_estimate(other)

  def device_batch(self, host_batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    return {k: jax.make_array_from_process_local_data(self.batch_shardings[k], host_batch[k],
                                                      (self.global_batch, *shape))
            for k, (shape, _) in self.row_specs.items()}

  # ---- the run (its loop over steps: train/step_loop.py) -----------------------------------------
  def _log_processes(self) -> None:
    local = [d for d in self.devices if d.process_index == jax.process_index()]
    log_host(f"host {socket.gethostname()}: {len(local)} local {local[0].platform} devices "
             f"(ids {local[0].id}-{local[-1].id})")
    if jax.process_count() > 1:
      plan = self.distributed
      log(f"distributed: {jax.process_count()} processes, {len(self.devices)} devices; coordinator "
          f"{plan.coordinator_address if plan else '?'} ({plan.source if plan else 'unknown'}); "
          "metrics, TensorBoard and config.yml are written by process 0")

  def _lock_run_dir(self) -> RunLock | None:
    """Process 0 takes the run directory's lock; every process learns whether it got it."""
    lock, problem = None, ""
    if jax.process_index() == 0:
      try:
        lock = RunLock(self.run_dir, log).acquire()
      except ConfigError as e:
        problem = str(e)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      if int(multihost_utils.broadcast_one_to_all(np.int32(bool(problem)))) and not problem:
        problem = "process 0 could not lock the run directory (see its log)"
    if problem:
      raise ConfigError(problem)
    return lock

  def run(self) -> int:
    try:
      lock = self._lock_run_dir()
    except ConfigError as e:
      log_error(f"config error: {e}")
      return EXIT_CONFIG
    keep_created()
    self.dead_previous_run = lock.taken_over if lock is not None else None
    try:
      return self._run_locked()
    finally:
      if lock is not None:
        lock.release()

  def _run_locked(self) -> int:
    cfg = self.cfg
    self._log_processes()
    log(f"model {cfg.decoder_block}: {stack.describe(self.family.layer_kinds(self.mcfg))}")
    platform = self.devices[0].platform
    log(f"mesh {dict(self.mesh.shape)} over {len(self.devices)} {platform} devices"
        f"{cpu_devices.describe(self.cpu_defaults, platform)}; "
        f"{auto_settings.describe(self.training)}")
    log(hot_path.describe(cfg.hot_path, self.mcfg.hot_path, platform))
    log(sharding_report(self.abstract["params"], self.shardings["params"]))
    if self.schedule is not None:
      log(self.schedule.describe())
    if jax.process_index() == 0:
      paths.makedirs(self.run_dir)
      paths.write_text(paths.join(self.run_dir, "config.yml"), to_yaml(cfg))
    ckpts = data_iter = saved_shards = None
    try:
      if cfg.enable_checkpointing:
        ckpts = RunCheckpoints(paths.join(self.run_dir, "checkpoints"),
                               max_to_keep=cfg.max_checkpoints_to_keep,
                               async_save=cfg.async_checkpointing,
                               save_timeout_s=cfg.checkpoint_save_timeout_s, save_hooks=faults)
        latest = ckpts.latest_step()
        if latest is not None and latest >= cfg.steps:
          log(f"nothing to do: the run already reached step {latest} of steps={cfg.steps}")
          ckpts.close()
          return EXIT_OK
        saved_shards = (data_state.saved_num_shards(ckpts.step_dir(latest))
                        if latest is not None else None)
      data_iter = self.open_data(saved_shards)
      self.clock.mark("data")
      with PreemptionWatch() as watch:
        code = self._train(ckpts, data_iter, watch)
      if ckpts is not None:
        ckpts.close()  # waits (bounded) for the last commit
        log(f"checkpoints in {ckpts.directory}: latest step {ckpts.latest_step()}")
      return code
    except ConfigError as e:
      log_error(f"config error: {e}")
      code = EXIT_CONFIG
    except DataError as e:
      log_error(f"data error: {e}")
      code = EXIT_DATA
    except CheckpointError as e:
      log_error(f"checkpoint error: {e}")
      code = EXIT_CHECKPOINT
    finally:
      if data_iter is not None:
        data_iter.close()
    if ckpts is not None:
      ckpts.abandon()  # a save still writing is let finish (bounded); a hung one is left behind
    return code

  def _train(self, ckpts: RunCheckpoints | None, data_iter: Any, watch: PreemptionWatch) -> int:
    """The run's steps: its state and step (`prepare`), the metrics writer, its parts
    (`loop_parts`), then the one loop (train/step_loop.py)."""
    cfg = self.cfg
    state, start = self.prepare(ckpts, data_iter)
    writer = MetricsWriter(self.run_dir, enable_tensorboard=cfg.enable_tensorboard,
                           is_primary=jax.process_index() == 0, start_step=start)
    if writer.superseded:
      log(superseded_note(writer, start, self.dead_previous_run, ckpts is not None))
    checkpoints = (Checkpointing(ckpts, cfg.as_dict(), data_iter, self.checkpointed)
                   if ckpts is not None else None)
    loop = None
    try:
      profiler = (StepProfiler.from_config(cfg, self.run_dir, start, log)
                  if jax.process_index() == 0 else None)
      loop = StepLoop(Schedule.from_config(cfg), self.loop_parts(state, start, writer, data_iter),
                      writer, checkpoints, watch, self.clock, profiler=profiler)
      self.clock.mark("metrics")
      return loop.run(state, start)
    finally:
      writer.close()
      self.final_state = loop.state if loop is not None and loop.state is not None else state

  def prepare(self, ckpts: RunCheckpoints | None, data_iter: Any) -> tuple[dict, int]:
    """(the state to start from, its step), with the train step compiled (`self.compiled`; while
    a restored checkpoint's arrays are checked) and its memory checked."""
    compiled = []

    def compile_once() -> None:   # while a restored checkpoint's arrays are checked, or after
      if not compiled:
        t0 = time.perf_counter()
        while not compiled:
          try:
            compiled.append(self.compile_step())
          except Exception as e:  # noqa: BLE001 — XLA refusing what does not fit: exit 2, one line
            if not memory.is_out_of_memory(e):
              raise
            if not self._lighter_remat(e):
              raise ConfigError(memory.compile_failure(e, self.memory_estimate(), memory_plan.fastest_fit(
                  self.estimate_with, self.cfg, after=self.cfg.remat_policy))) from None
        log(f"compiled the train step in {time.perf_counter() - t0:.1f} s")

    state, start = self.checkpointed.initial_state(ckpts, data_iter, meanwhile=compile_once)
    self.clock.mark("init" if not compiled else "init + compile")
    if not compiled:
      compile_once()
      self.clock.mark("compile")
    self.compiled = compiled[0]
    line, problem = memory.check_compiled(self.compiled, self.devices)
    if problem:
      raise ConfigError(problem)
    if line:
      log(line)
    return state, start

  def loop_parts(self, state: dict, start: int, writer: MetricsWriter, data_iter: Any
                 ) -> LoopParts:
    """The pre-training / SFT step plugged into the loop: the compiled step, the next host batch
    made global, the step's row (tokens/s, TFLOP/s, MFU), the progress line (with the family's
    watch), evaluation and samples."""
    del state, start
    cfg = self.cfg
    flops = training_flops(self.mcfg, seq_len=cfg.max_target_length,
                           global_batch=self.global_batch)
    peak = device_peak_tflops(self.devices[0], cfg.peak_tflops_per_device, cfg.dtype)
    bubble = ("" if self.schedule is None else
              f"; the pipeline's bubble leaves the stages idle {self.schedule.bubble_fraction:.1%} "
              f"of the decoder's time, so MFU is at most {1 - self.schedule.bubble_fraction:.1%} "
              f"of what it would be without")
    log(f"{flops['total'] / 1e12:.4f} TFLOP per step; MFU against {peak.tflops:.3g} TFLOP/s per "
        f"device ({peak.source}){bubble}")
    rows = StepRows(flops["total"], peak.tflops, self.global_batch * cfg.max_target_length,
                    len(self.devices), peak.under_load, writer.earlier_losses)
    return LoopParts(step=self.compiled,
                     next_batch=lambda step, state: self.device_batch(next(data_iter)),
                     rows=rows, progress=StepProgress(self.aux_terms),
                     periodic=Periodic(self, data_iter, writer, log))

  def open_data(self, saved_shards: int | None) -> Any:
    """The training data iterator (positioned at the start; a restore moves it): this process's
    data shards (`saved_shards`: how many the run's checkpoint was saved with, None: fresh)."""
    layout = data_layout(self.cfg.data_shards, saved_shards, jax.process_count(),
                         self.global_batch, self.rows)
    log_host(layout.describe(self.global_batch))
    return make_shard_iterator(self.data_config, layout.shard_ids, layout.num_shards,
                               layout.shard_batch, self.tokenizer)


def build(argv: Sequence[str], devices: Sequence[Device] | None = None,
          trainer_class: type[Trainer] = Trainer, clock: StartupClock | None = None) -> Trainer:
  """The Trainer of `argv` (base.yml path, then key=value): config loaded and checked, processes
  joined, mesh, abstract state and the memory pre-flight — nothing compiled or loaded yet. Raises
  ConfigError / DataError (exit 2), BadRecordsError (the first records: exit 3) or CheckpointError
  (exit 4). Also what MaxText/rl/policy.py loads a policy with."""
  clock = clock or StartupClock()
  # dtype=auto resolved for training below; keys the trainer does not read refused
  cfg = load_config(argv, keep_auto=True, tool=trainer_class.tool)
  cfg = adopt_architecture(cfg, argv, training=True)   # config file, then the model's, then argv
  cfg, tokenizer_line = choose_tokenizer(cfg)
  cache_line = setup_jax(cfg)
  plan = distributed.initialize(cfg)  # before anything touches a device
  cpu_defaults = (cpu_devices.apply_default(hot_path=cfg.hot_path, cfg=cfg)
                  if plan is None and devices is None else None)
  log(tokenizer_line)
  log(cache_line)
  training = auto_settings.for_training(cfg)   # the one resolution of the auto values
  cfg = training.cfg
  if cfg.hf_path:
    check_tensors(cfg)   # a missing / misshapen tensor: exit 4 before anything compiles
  tokenizer = check_config(cfg, list(jax.devices() if devices is None else devices))
  cpu_defaults = cpu_devices.apply_host_allocator(cpu_defaults, jax.devices()[0].platform,
                                                 hot_path=cfg.hot_path)
  clock.mark("config + devices")
  trainer = trainer_class(training, devices, tokenizer)  # abstract shapes and shardings only
  trainer.clock = clock
  trainer.distributed = plan
  trainer.cpu_defaults = cpu_defaults
  est = trainer.memory_estimate()   # state + activations (per remat policy, rows, loss chunk)
  if est.needed > est.limit:   # on an accelerator: beyond the estimate's error, else XLA decides
    halved = None if cfg.weight_dtype == "bfloat16" else trainer.with_weight_dtype("bfloat16")
    raise ConfigError(memory.check_fits(est, memory.advice(
        est, trainer.abstract, family_models_that_fit(cfg, argv, devices),
        trainer.trained_params(),
        None if halved is None else memory.Alternative(
            "weight_dtype=bfloat16", halved.memory_estimate(),
            memory.total_state_bytes(halved.abstract, halved.trained_params(),
                                     bool(est.reference))),
        memory_plan.fastest_fit(trainer.estimate_with, trainer.cfg))))
  if tight := memory.warning(est):
    log_error(f"warning: {tight}")
  clock.mark("mesh")
  return trainer


def run(argv: Sequence[str], devices: Sequence[Device] | None = None,
        trainer_class: type[Trainer] = Trainer) -> tuple[int, Trainer | None]:
  """Trains per `argv` (base.yml path, then key=value); returns (exit status, the Trainer).
  `trainer_class`: a Trainer with its own data and loop (e.g. MaxText/rl/grpo.py)."""
  try:
    trainer = build(argv, devices, trainer_class, StartupClock())
  except BadRecordsError as e:   # the first records, read before compiling (data/probe.py)
    remove_created()
    log_error(f"data error: {e}")
    return EXIT_DATA, None
  except (ConfigError, DataError) as e:   # a missing data file too: the key names it (README)
    remove_created()
    log_error(f"config error: {e}")
    return EXIT_CONFIG, None
  except CheckpointError as e:   # e.g. a quantized checkpoint of an older layout
    remove_created()
    log_error(f"checkpoint error: {e}")
    return EXIT_CHECKPOINT, None
  return trainer.run(), trainer


def family_models_that_fit(cfg: Config, argv: Sequence[str],
                           devices: Sequence[Device] | None) -> list[tuple[str, int]]:
  """[(model_name, bytes per device)] of the other configs/models files of this run's family that
  fit here with the same command line, largest first (none with load_parameters_path)."""
  if cfg.load_parameters_path:
    return []
  folder = models_dir(argv[0])
  names = sorted(f[:-4] for f in os.listdir(folder) if f.endswith(".yml")) \
      if os.path.isdir(folder) else []
  rest = [a for a in argv[1:] if a.split("=", 1)[0] not in ARCHITECTURE_KEYS | {"model_name"}]
  fits = []
  for name in names:
    if name == cfg.model_name:
      continue
    try:
      other = load_config([argv[0], f"model_name={name}", *rest], keep_auto=True)
      if other.decoder_block != cfg.decoder_block:
        continue
      est = Trainer(other, devices).memory_estimate()
    except (ConfigError, ValueError):
      continue   # this mesh does not suit that model
    if est.fits:
      fits.append((name, est.needed))
  return sorted(fits, key=lambda f: -f[1])


def main(argv: Sequence[str], devices: Sequence[Device] | None = None,
         trainer_class: type[Trainer] = Trainer) -> int:
  """`run`'s exit status. Ctrl-C (a second one during the steps: `preemption.StopNow`; one before or
  after them) ends the run with one line and exit 130 (128 + SIGINT), as a second SIGTERM ends it
  with 143, never a traceback: the step in flight is not saved; a rerun resumes from the last
  committed checkpoint."""
  try:
    code = run(argv, devices, trainer_class)[0]
  except StopNow as e:
    log_error(str(e))
    code = e.exit_status
  except KeyboardInterrupt:
    log_error(f"interrupted (SIGINT): exiting now, without saving the step in flight (exit "
              f"{EXIT_INTERRUPTED})")
    code = EXIT_INTERRUPTED
  distributed.shutdown(code)
  return code
