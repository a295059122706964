"""The one loop over steps (MaxText/train/step_loop.py) with a toy trainer that is only a step
function and its data (no model, no Trainer): each step's metrics are read one step late and
before a save, checkpoints follow the cadence (and restore to the state the steps made), a
non-finite step is skipped up to the limit or halts with exit 5 and no new checkpoint, and a
SIGTERM is answered with the step saved and committed, exit 42. What docs/architecture.md's
"One loop" section says a new trainer (DPO, distillation) provides."""
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np

import conftest  # noqa: F401  (fake devices, compilation cache)
from MaxText.checkpoint.manager import RunCheckpoints
from MaxText.metrics.writers import MetricsWriter
from MaxText.runtime.preemption import PreemptionWatch
from MaxText.train.step_loop import LoopParts, Schedule, StepLoop
from MaxText.train.step_rows import host_values
from MaxText.train.trainer_state import Checkpointing

STEPS = 6


@jax.jit
def toy_step(state, batch):
  """w += x; the update is applied only if the loss is finite (as train/step.py's guard)."""
  w = state["params"]["w"] + batch["x"]
  loss = jnp.sum(w)
  finite = jnp.isfinite(loss)
  new = {"step": state["step"] + 1, "params": {"w": jnp.where(finite, w, state["params"]["w"])},
         "opt_state": {"count": state["opt_state"]["count"] + finite.astype(jnp.int32)}}
  return new, {"loss": loss, "finite": finite.astype(jnp.float32)}


def toy_state():
  return {"step": jnp.int32(0), "params": {"w": jnp.zeros(4, jnp.float32)},
          "opt_state": {"count": jnp.int32(0)}}


def batch_of(step: int, nan_at: tuple[int, ...]) -> dict:
  x = np.full(4, float(step), np.float32)
  return {"x": jnp.asarray(np.full(4, np.nan, np.float32) if step in nan_at else x)}


class ToyRows:
  def __init__(self, events):
    self.events = events

  def row(self, metrics):
    row = host_values(metrics)
    self.events.append(f"read {len([e for e in self.events if e.startswith('read')]) + 1}")
    return row

  def exclude(self, seconds):
    del seconds


class ToyProgress:
  def line(self, step, row, steps):
    return f"toy {step}/{steps} loss {row['loss']}"

  def warning(self, step, row):
    del step, row
    return None


class RecordedSaves(Checkpointing):
  def __init__(self, events, *a, **kw):
    super().__init__(*a, **kw)
    self.events = events

  def save(self, step, state):
    self.events.append(f"save {step}")
    super().save(step, state)


def run_toy(tmp_path, schedule: Schedule, nan_at=(), sigterm_at=None):
  """(exit status, events, the loop, the run's checkpoints, printed lines) of the toy trainer."""
  events, lines = [], []

  def step(state, batch):
    events.append(f"dispatch {len([e for e in events if e.startswith('dispatch')]) + 1}")
    out = toy_step(state, batch)
    if sigterm_at == len([e for e in events if e.startswith("dispatch")]):
      os.kill(os.getpid(), signal.SIGTERM)
    return out

  parts = LoopParts(step=step, next_batch=lambda s, state: batch_of(s, nan_at),
                    rows=ToyRows(events), progress=ToyProgress())
  ckpts = RunCheckpoints(str(tmp_path / "checkpoints"), max_to_keep=10, async_save=True)
  writer = MetricsWriter(str(tmp_path), enable_tensorboard=False, is_primary=True, start_step=0)
  try:
    with PreemptionWatch() as watch:
      loop = StepLoop(schedule, parts, writer, RecordedSaves(events, ckpts, {}), watch,
                      log=lines.append)
      code = loop.run(toy_state(), 0)
    ckpts.wait()
  finally:
    writer.close()
  return code, events, loop, ckpts, lines


def _restored_w(ckpts):
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one),
                          toy_state())
  state, step = ckpts.restore_latest(abstract, None, verify=True, fallback=False, log=print)
  return step, np.asarray(state["params"]["w"])


def test_toy_trainer_reads_one_step_late_and_saves_on_the_cadence(tmp_path):
  code, events, loop, ckpts, lines = run_toy(tmp_path, Schedule(STEPS, log_period=1,
                                                                checkpoint_period=4))
  assert code == 0
  assert events == ["dispatch 1", "dispatch 2", "read 1", "dispatch 3", "read 2",
                    "dispatch 4", "read 3", "read 4", "save 4",
                    "dispatch 5", "dispatch 6", "read 5", "read 6", "save 6"]
  assert ckpts.all_steps() == [4, 6]
  step, w = _restored_w(ckpts)
  assert step == 6 and np.all(w == sum(range(1, STEPS + 1)))   # the state the six steps made
  np.testing.assert_array_equal(np.asarray(loop.state["params"]["w"]), w)
  assert lines[0] == "toy 1/6 loss 4.0" and len(lines) == STEPS
  ckpts.close()


def test_toy_trainer_nonfinite_step_halts_without_a_new_checkpoint(tmp_path):
  code, events, _, ckpts, lines = run_toy(tmp_path, Schedule(STEPS, checkpoint_period=2,
                                                             nonfinite_policy="halt"), nan_at=(3,))
  assert code == 5
  assert "save 4" not in events and ckpts.all_steps() == [2]
  assert any(l.startswith("halting: non-finite loss or gradient at step 3 (not applied; "
                          "nonfinite_policy=halt, 1 such steps)") for l in lines), lines
  ckpts.close()


def test_toy_trainer_skips_nonfinite_steps_up_to_the_limit(tmp_path):
  code, _, loop, ckpts, lines = run_toy(tmp_path, Schedule(STEPS, checkpoint_period=2,
                                                           max_nonfinite_skips=1), nan_at=(3,))
  assert code == 0 and "skipped step 3: non-finite loss or gradient (1/1)" in lines
  step, w = _restored_w(ckpts)
  assert step == 6 and np.all(w == 1 + 2 + 4 + 5 + 6)   # step 3 not applied
  assert int(loop.state["opt_state"]["count"]) == 5
  ckpts.close()


def test_toy_trainer_sigterm_saves_the_step_and_exits_42(tmp_path, capsys):
  code, events, _, ckpts, _ = run_toy(tmp_path, Schedule(STEPS, checkpoint_period=2),
                                      sigterm_at=3)
  assert code == 42
  assert events[-2:] == ["read 3", "save 3"] and "dispatch 4" not in events
  assert ckpts.all_steps() == [2, 3]
  step, w = _restored_w(ckpts)
  assert step == 3 and np.all(w == 1 + 2 + 3)
  assert "preempted (SIGTERM): step 3 saved and committed" in capsys.readouterr().out
  ckpts.close()
