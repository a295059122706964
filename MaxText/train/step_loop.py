"""The Trainer's loop over steps (`train/loop.py: Trainer` is a `StepLoop`): the compiled step
dispatched step after step, each step's metrics read back one step late (while the next runs) and
written as a row and progress line, the non-finite policy, evaluation / samples between steps
(train/periodic.py), checkpoints every `checkpoint_period` steps and at the end, and a preemption
signal answered with a saved, committed step and exit 42. Uses the Trainer's setup (`cfg`, `mcfg`,
`devices`, `global_batch`, `run_dir`, `aux_terms`, `clock`, `compile_step`, `device_batch`) and
its state part (train/trainer_state.py)."""
from __future__ import annotations

import time
from typing import Any

import jax

from MaxText.checkpoint.manager import RunCheckpoints
from MaxText.config.load import ConfigError
from MaxText.metrics.peaks import device_peak_tflops
from MaxText.metrics.writers import MetricsWriter, format_line
from MaxText.models.registry import training_flops
from MaxText.runtime import faults
from MaxText.runtime.exit_codes import EXIT_NONFINITE, EXIT_OK, EXIT_PREEMPTED
from MaxText.runtime.preemption import PreemptionWatch
from MaxText.runtime.run_dir import describe as describe_holder
from MaxText.train import memory
from MaxText.train.periodic import Periodic
from MaxText.train.run_log import log, log_host
from MaxText.train.step_rows import StepRows


class StepLoop:
  """The loop part of `Trainer` (module docstring)."""

  def _train(self, ckpts: RunCheckpoints | None, data_iter: Any, watch: PreemptionWatch) -> int:
    cfg = self.cfg
    compiled = []

    def compile_once() -> None:   # while a restored checkpoint's arrays are checked, or after
      if not compiled:
        t0 = time.perf_counter()
        compiled.append(self.compile_step())
        log(f"compiled the train step in {time.perf_counter() - t0:.1f} s")

    state, start = self.initial_state(ckpts, data_iter, meanwhile=compile_once)
    self._first_step = start + 1
    self.clock.mark("init" if not compiled else "init + compile")
    if not compiled:
      compile_once()
      self.clock.mark("compile")
    compiled = compiled[0]
    line, problem = memory.check_compiled(compiled, self.devices)
    if problem:
      raise ConfigError(problem)
    if line:
      log(line)
    flops = training_flops(self.mcfg, seq_len=cfg.max_target_length,
                           global_batch=self.global_batch)
    peak = device_peak_tflops(self.devices[0], cfg.peak_tflops_per_device, cfg.dtype)
    log(f"{flops['total'] / 1e12:.4f} TFLOP per step; MFU against {peak.tflops:.3g} TFLOP/s per "
        f"device ({peak.source})")
    writer = MetricsWriter(self.run_dir, enable_tensorboard=cfg.enable_tensorboard,
                           is_primary=jax.process_index() == 0, start_step=start)
    if writer.superseded:
      log(superseded_note(writer, start, self.dead_previous_run, ckpts is not None))
    config_dict = cfg.as_dict()
    # the family's view of the metrics (e.g. MoE: expert load on the line, collapse warnings)
    self._family_watch = self.aux_terms.watch() if self.aux_terms is not None else None
    wait_for_saves = ckpts.wait if ckpts is not None else (lambda: None)
    periodic = Periodic(self, data_iter, writer, log)   # evaluation and samples

    self.clock.mark("metrics")
    batch = self.device_batch(next(data_iter))
    self.clock.mark("first batch")
    self._skipped = 0
    rows = StepRows(flops["total"], peak.tflops, self.global_batch * cfg.max_target_length,
                    len(self.devices), peak.under_load, writer.earlier_losses)
    pending = None   # (step, metrics) of the dispatched step not yet read back
    try:
      for step in range(start + 1, cfg.steps + 1):
        state, metrics = compiled(state, batch)
        # The previous step's metrics are read while this one runs (no host sync per step). A
        # step that saves, stops or ends the run reads its own metrics before going on: a
        # checkpoint is only written once its step (and every step before it) was seen finite.
        if pending is not None:
          code = self._finish_step(*pending, rows, writer, ckpts)
          if code is not None:
            return code
        pending = (step, metrics)
        faults.after_dispatch(step, wait_for_saves)
        # decided before the next batch is read, so a saved iterator position matches the state
        stop = watch.should_stop(step) and step < cfg.steps
        save_now = ckpts is not None and (step % cfg.checkpoint_period == 0 or step == cfg.steps
                                          or stop)
        periodic_now = not stop and periodic.due(step)   # evaluation or samples after this step
        if not (save_now or stop or periodic_now or step == cfg.steps):
          batch = self.device_batch(next(data_iter))  # the next host batch, while this step runs
          continue
        code = (self._finish_step(*pending, rows, writer, ckpts)
                if pending is not None else None)
        pending = None
        if code is not None:
          return code
        if save_now:   # first: nothing after a finished step can cost its checkpoint
          self.save_checkpoint(ckpts, step, state, data_iter, config_dict)
        if periodic_now:   # a failure here is logged, never fatal (train/periodic.py)
          rows.exclude(periodic.after_step(step, state["params"]))   # its time is no step's
        if stop:
          return self._preempted(step, ckpts, watch)
        if step < cfg.steps:   # after a save, so the saved iterator position matches its state
          batch = self.device_batch(next(data_iter))
    finally:
      writer.close()
      self.final_state = state
    return EXIT_OK

  def _finish_step(self, step: int, metrics: dict, rows: StepRows, writer: MetricsWriter,
                   ckpts: RunCheckpoints | None) -> int | None:
    """Reads back one step's metrics (waiting for the step), writes its row and progress line and
    applies the non-finite policy; returns an exit status to stop with, or None to go on."""
    cfg, family_watch = self.cfg, self._family_watch
    metrics = rows.row(metrics)
    writer.write(step, metrics)
    finite = bool(metrics["finite"])
    if step % cfg.log_period == 0 or step in (self._first_step, cfg.steps) or not finite:
      log(format_line(step, metrics, cfg.steps,
                      [family_watch.progress(metrics)] if family_watch else []))
    if step == self._first_step:
      self.clock.mark("first step")
      log(self.clock.line())
    if family_watch and (warning := family_watch.update(step, metrics)):
      log(warning)
    if ckpts is not None:
      ckpts.check()  # an earlier async save that failed or hung stops the run here
    if finite:
      return None
    self._skipped += 1
    if cfg.nonfinite_policy == "halt" or self._skipped > cfg.max_nonfinite_skips:
      log(f"halting: non-finite loss or gradient at step {step} (not applied; "
          f"nonfinite_policy={cfg.nonfinite_policy}, {self._skipped} such steps); "
          f"no new checkpoint is written")
      return EXIT_NONFINITE
    log(f"skipped step {step}: non-finite loss or gradient ({self._skipped}/"
        f"{cfg.max_nonfinite_skips})")
    return None

  def _preempted(self, step: int, ckpts: RunCheckpoints | None, watch: PreemptionWatch) -> int:
    what = watch.signal_name or "the preemption service"
    if ckpts is None:
      log_host(f"preempted ({what}) after step {step}; nothing saved (enable_checkpointing=false)")
      return EXIT_PREEMPTED
    ckpts.wait()  # the commit of this step: a failure or hang raises CheckpointError (exit 4)
    since = (f" {time.monotonic() - watch.received_at:.1f} s after the signal"
             if watch.received_at is not None else "")
    log_host(f"preempted ({what}): step {step} saved and committed{since}; exit {EXIT_PREEMPTED} "
             "(rerun to resume)")
    return EXIT_PREEMPTED


def superseded_note(writer: MetricsWriter, start: int, dead_run: dict | None,
                    checkpointing: bool) -> str:
  """What the rows `writer` moved aside on opening were, from what this run can know: the holder
  of a stale run lock it took over (`dead_run`: that run died — a crash, an abort, a kill —
  without releasing it) or none (the run before ended and released its lock, yet its rows go past
  the step this run starts from). A preempted run saves its last step before it exits, so its
  rows never go past its checkpoint."""
  steps = writer.superseded_steps
  rows = (f"{writer.superseded} rows" + (f" (steps {min(steps)}-{max(steps)})" if steps else ""))
  if dead_run is not None:
    when = f"after its last checkpoint (step {start})" if start else "before any checkpoint"
    why = (f"written by a run that died without finishing ({describe_holder(dead_run)}: it left "
           f"its run lock behind, so it crashed, aborted or was killed) {when}")
  elif not checkpointing:
    why = "written by an earlier run in this directory (enable_checkpointing=false: no step to " \
          "resume from)"
  else:
    why = (f"written by an earlier run in this directory that ended (it released its run lock) "
           f"with no checkpoint {f'after step {start}' if start else 'at all'}: its saves were "
           f"off, failed or were deleted, or an older step was restored")
  return (f"metrics.jsonl: {rows} {why}; moved to {MetricsWriter.SUPERSEDED_NAME}, "
          f"recomputed from step {start + 1}")
