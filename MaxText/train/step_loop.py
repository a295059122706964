"""The one loop over steps, shared by every trainer (pre-training, SFT / LoRA, GRPO, and any new
one): a trainer is a step function plus its data, and a few small collaborators (`LoopParts`);
the loop owns the order of things between steps.

Per step: the step is dispatched (`step(state, batch)`: no host wait), the previous step's metrics
are read back while this one runs (`rows.row(metrics)`: the one wait per step) and written as a row
(metrics.jsonl, TensorBoard) and, every `log_period` steps, a progress line (`progress`); then the
non-finite policy (`finite` in the row: skip up to `max_nonfinite_skips`, or halt → exit 5, no new
checkpoint), the checkpoint every `checkpoint_period` steps, at the end and on preemption
(`checkpoints`), then evaluation / samples when due (`periodic`; after the save, so a failure there
— logged, never fatal — cannot cost the step's checkpoint), and a preemption signal answered with
the step saved and committed → exit 42. A step that saves, stops, evaluates or ends the run is read back
before that, so a checkpoint is only ever written of a step (and every step before it) seen finite.
The next batch is asked for (`next_batch(step, state)`) after the step before it was dispatched and
after any save, so a saved data position matches its state.

See docs/architecture.md, "One loop": what a new trainer provides.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Protocol

from MaxText.config.schema import Config
from MaxText.metrics.profiler import StepProfiler
from MaxText.metrics.writers import MetricsWriter
from MaxText.runtime import faults
from MaxText.runtime.exit_codes import EXIT_NONFINITE, EXIT_OK, EXIT_PREEMPTED
from MaxText.runtime.preemption import PreemptionWatch
from MaxText.runtime.run_dir import describe as describe_holder
from MaxText.runtime.startup import StartupClock
from MaxText.train.run_log import log as run_log, log_host


@dataclasses.dataclass(frozen=True)
class Schedule:
  """The loop's keys: how many steps, how often a progress line and a checkpoint, the non-finite
  policy."""
  steps: int
  log_period: int = 1
  checkpoint_period: int = 1
  nonfinite_policy: str = "skip"        # "skip" (up to max_nonfinite_skips) or "halt"
  max_nonfinite_skips: int = 0

  @classmethod
  def from_config(cls, cfg: Config) -> "Schedule":
    return cls(cfg.steps, cfg.log_period, cfg.checkpoint_period, cfg.nonfinite_policy,
               cfg.max_nonfinite_skips)


class Rows(Protocol):
  """A step's metrics → its row (metrics.jsonl); holds `finite`. `row` may wait for the step."""
  def row(self, metrics: Any) -> dict: ...
  def exclude(self, seconds: float) -> None: ...   # time between steps that is no step's


class Progress(Protocol):
  def line(self, step: int, row: dict, steps: int) -> str: ...
  def warning(self, step: int, row: dict) -> str | None: ...   # e.g. a family's watch


class Periodic(Protocol):
  """Work between steps (evaluation, samples): `due(step)`, then `after_step(step, params)` →
  the seconds it took; it logs its own failures (a finished step is never lost to one)."""
  def due(self, step: int) -> bool: ...
  def after_step(self, step: int, params: Any) -> float: ...


class Checkpoints(Protocol):
  """The state holder's sink: `save` hands a step's state (and its data position) to the
  checkpointer (async), `check` raises CheckpointError for an earlier save that failed or hung
  (non-blocking), `wait` blocks until the last save committed."""
  def save(self, step: int, state: Any) -> None: ...
  def check(self) -> None: ...
  def wait(self) -> None: ...


@dataclasses.dataclass
class LoopParts:
  """What a trainer plugs into the loop. `step(state, batch) -> (state, metrics)` dispatches one
  step (device values; no host wait). `next_batch(step, state)`: the batch of `step`, from the
  state it starts from (dispatched, maybe not computed yet; pre-training ignores it, GRPO samples
  its rollout from it). The state is the train-state dict; `periodic` reads its "params"."""
  step: Callable[[Any, Any], tuple[Any, Any]]
  next_batch: Callable[[int, Any], Any]
  rows: Rows
  progress: Progress
  periodic: Periodic | None = None


class StepLoop:
  """One run of the loop (module docstring). After `run`, `state` holds the last state (also when
  it raised)."""

  def __init__(self, schedule: Schedule, parts: LoopParts, writer: MetricsWriter,
               checkpoints: Checkpoints | None, watch: PreemptionWatch,
               clock: StartupClock | None = None, log: Callable[[str], None] = run_log,
               profiler: StepProfiler | None = None):
    self.schedule, self.parts, self.writer = schedule, parts, writer
    self.profiler = profiler   # `profiler=xplane`: traces a window of steps (metrics/profiler.py)
    self.checkpoints, self.watch, self.clock, self.log = checkpoints, watch, clock, log
    self.state: Any = None
    self.skipped = 0

  def run(self, state: Any, start: int) -> int:
    """Steps start + 1 … schedule.steps from `state`; the exit status (0, 5 or 42)."""
    sched, parts, ckpts = self.schedule, self.parts, self.checkpoints
    self.state, self._first = state, start + 1
    wait_for_saves = ckpts.wait if ckpts is not None else (lambda: None)
    batch = parts.next_batch(start + 1, state)
    if self.clock is not None:
      self.clock.mark("first batch")
    pending = None   # (step, metrics) of the dispatched step not yet read back
    prof = self.profiler
    for step in range(start + 1, sched.steps + 1):
      if prof is not None:
        prof.before_step(step, state)
      state, metrics = parts.step(state, batch)
      self.state = state
      if prof is not None:
        prof.after_step(step, state)
      # The previous step's metrics are read while this one runs (no host sync per step).
      if pending is not None:
        code = self._finish_step(*pending)
        if code is not None:
          return code
      pending = (step, metrics)
      faults.after_dispatch(step, wait_for_saves)
      # decided before the next batch is read, so a saved data position matches the state
      stop = self.watch.should_stop(step) and step < sched.steps
      save_now = ckpts is not None and (step % sched.checkpoint_period == 0
                                        or step == sched.steps or stop)
      periodic_now = not stop and parts.periodic is not None and parts.periodic.due(step)
      if not (save_now or stop or periodic_now or step == sched.steps):
        batch = parts.next_batch(step + 1, state)   # the next batch, while this step runs
        continue
      code = self._finish_step(*pending)
      pending = None
      if code is not None:
        return code
      # first: nothing after a finished step can cost its checkpoint (save_now: ckpts is set)
      if save_now and ckpts is not None:
        ckpts.save(step, state)
        self.writer.flush()   # the rows so far reach an object store with the step's checkpoint
      # a failure there is logged, never fatal (train/periodic.py)
      if periodic_now and parts.periodic is not None:
        parts.rows.exclude(parts.periodic.after_step(step, state["params"]))  # no step's time
      if stop:
        return self._preempted(step)
      if step < sched.steps:   # after a save, so the saved data position matches its state
        batch = parts.next_batch(step + 1, state)
    return EXIT_OK

  def _finish_step(self, step: int, metrics: Any) -> int | None:
    """Reads back one step's metrics (waiting for the step), writes its row and progress line and
    applies the non-finite policy; returns an exit status to stop with, or None to go on."""
    sched, parts = self.schedule, self.parts
    row = parts.rows.row(metrics)
    self.writer.write(step, row)
    finite = bool(row["finite"])
    if step % sched.log_period == 0 or step in (self._first, sched.steps) or not finite:
      self.log(parts.progress.line(step, row, sched.steps))
    if step == self._first and self.clock is not None:
      self.clock.mark("first step")
      self.log(self.clock.line())
    if warning := parts.progress.warning(step, row):
      self.log(warning)
    if self.checkpoints is not None:
      self.checkpoints.check()  # an earlier async save that failed or hung stops the run here
    if finite:
      return None
    self.skipped += 1
    if sched.nonfinite_policy == "halt" or self.skipped > sched.max_nonfinite_skips:
      self.log(f"halting: non-finite loss or gradient at step {step} (not applied; "
               f"nonfinite_policy={sched.nonfinite_policy}, {self.skipped} such steps); "
               f"no new checkpoint is written")
      return EXIT_NONFINITE
    self.log(f"skipped step {step}: non-finite loss or gradient ({self.skipped}/"
             f"{sched.max_nonfinite_skips})")
    return None

  def _preempted(self, step: int) -> int:
    watch, ckpts = self.watch, self.checkpoints
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
