"""The loop reads each step's metrics one step late (no host sync per step): step N's row is
read after step N+1 is dispatched, except that a step that saves (or ends the run) is read before
its checkpoint is written, so only a step seen finite is ever saved. Waiting for each step as soon
as it is dispatched (what benchmarks/metrics_lag.py compares against: a host sync per step) gives
the same rows."""
import jax

from conftest import MESH_1, argv, read_metrics
from MaxText.train.loop import Trainer, run


class Timeline(Trainer):
  """Records the order of the step's dispatches, metrics reads and checkpoint saves."""

  def __init__(self, *a, **kw):
    super().__init__(*a, **kw)
    self.events: list[str] = []

  def compile_step(self):
    compiled = super().compile_step()

    def step(state, batch):
      self.events.append(f"dispatch {sum(e.startswith('dispatch') for e in self.events) + 1}")
      return self.dispatched(compiled, state, batch)
    return step

  def dispatched(self, compiled, state, batch):
    return compiled(state, batch)

  def _finish_step(self, step, *a):
    self.events.append(f"read {step}")
    return super()._finish_step(step, *a)

  def save_checkpoint(self, ckpts, step, *a):
    self.events.append(f"save {step}")
    return super().save_checkpoint(ckpts, step, *a)


class Synced(Timeline):
  """Each step waited for at once (the benchmark's "at once")."""

  def dispatched(self, compiled, state, batch):
    return jax.block_until_ready(compiled(state, batch))


def test_metrics_read_one_step_late_and_before_each_save(tmp_path):
  keys = (*MESH_1, "steps=5", "checkpoint_period=2", "per_device_batch_size=2")
  rows, events = {}, {}
  for name, cls in (("late", Timeline), ("synced", Synced)):
    code, trainer = run(argv(tmp_path, name, *keys), devices=jax.devices()[:1], trainer_class=cls)
    assert code == 0
    rows[name], events[name] = read_metrics(tmp_path / name), trainer.events
  assert events["late"] == events["synced"] == [
      "dispatch 1", "dispatch 2", "read 1", "read 2", "save 2",
      "dispatch 3", "dispatch 4", "read 3", "read 4", "save 4",
      "dispatch 5", "read 5", "save 5"]
  assert [r["step"] for r in rows["late"]] == [r["step"] for r in rows["synced"]] == [1, 2, 3, 4, 5]
  for a, b in zip(rows["late"], rows["synced"]):
    assert (a["loss"], a["grad_norm"], a["batch_checksum"]) == \
        (b["loss"], b["grad_norm"], b["batch_checksum"])
