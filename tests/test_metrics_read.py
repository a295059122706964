"""The loop reads each step's metrics one step late (no host sync per step): step N's row is
read after step N+1 is dispatched, except that a step that saves (or ends the run) is read before
its checkpoint is written, so only a step seen finite is ever saved. Waiting for each step as soon
as it is dispatched (what benchmarks/metrics_lag.py compares against: a host sync per step) gives
the same rows."""
import jax

from conftest import MESH_1, argv, read_metrics
from MaxText.train.loop import Trainer, run


def record_saves(trainer) -> list[str]:
  """The trainer's event list, with each checkpoint save recorded in it ("save N")."""
  events: list[str] = []
  save = trainer.checkpointed.save_checkpoint

  def save_checkpoint(ckpts, step, *a):
    events.append(f"save {step}")
    return save(ckpts, step, *a)
  trainer.checkpointed.save_checkpoint = save_checkpoint
  return events


class Timeline(Trainer):
  """Records the order of the step's dispatches, metrics reads and checkpoint saves (wrapping the
  loop's parts: train/step_loop.py)."""

  def __init__(self, *a, **kw):
    super().__init__(*a, **kw)
    self.events = record_saves(self)

  def loop_parts(self, *a):
    parts = super().loop_parts(*a)
    compiled, read = parts.step, parts.rows.row
    reads = iter(range(1, 10**6))

    def step(state, batch):
      self.events.append(f"dispatch {sum(e.startswith('dispatch') for e in self.events) + 1}")
      return self.dispatched(compiled, state, batch)

    def row(metrics):
      self.events.append(f"read {next(reads)}")
      return read(metrics)
    parts.step, parts.rows.row = step, row
    return parts

  def dispatched(self, compiled, state, batch):
    return compiled(state, batch)


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


class RecordsBatches(Trainer):
  def __init__(self, *a, **kw):
    super().__init__(*a, **kw)
    self.fed = []

  def device_batch(self, host_batch):
    batch = super().device_batch(host_batch)
    self.fed.append(batch)
    return batch


def test_batch_checksum_row_is_the_checksum_of_that_steps_batch(tmp_path):
  """The step computes its batch's checksum itself (no program of its own per step): each row's
  `batch_checksum` is the checksum of the batch that step was fed, over 2 devices."""
  from MaxText.checkpoint.checksum import batch_checksum
  keys = ("ici_fsdp_parallelism=2", "steps=3", "per_device_batch_size=1")
  code, trainer = run(argv(tmp_path, "rec", *keys), devices=jax.devices()[:2],
                      trainer_class=RecordsBatches)
  assert code == 0
  rows = read_metrics(tmp_path / "rec")
  assert len(trainer.fed) == len(rows) == 3
  expected = [int(batch_checksum(b)) for b in trainer.fed]
  assert len(set(expected)) == 3   # the batches differ, so a row of another step would not match
  assert [r["batch_checksum"] for r in rows] == expected


def test_metrics_are_read_as_their_dtype():
  """The loop reads each step metric as the Python number of its dtype, naming none: an integer
  metric (the uint32 batch checksum, above 2^31 here) stays an exact int, a floating one is the
  float of its value (bf16 and fp32 alike)."""
  import jax.numpy as jnp
  from MaxText.train.step_rows import host_values
  got = host_values({"checksum": jnp.uint32(4_000_000_001), "tokens": jnp.int32(-7),
                     "loss": jnp.float32(0.1), "aux": jnp.bfloat16(0.1)})
  assert got == {"checksum": 4_000_000_001, "tokens": -7, "loss": float(jnp.float32(0.1)),
                 "aux": float(jnp.bfloat16(0.1))}
  assert [type(got[k]) for k in ("checksum", "tokens", "loss", "aux")] == [int, int, float, float]
