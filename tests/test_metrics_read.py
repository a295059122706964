"""The loop reads each step's metrics one step late (no host sync per step); reading them at once
(`Trainer.read_metrics_late = False`, the former loop, kept for benchmarks/metrics_lag.py) gives
the same rows, also around a checkpoint and at the end."""
import jax

from conftest import MESH_1, argv, read_metrics
from MaxText.train.loop import Trainer, run


class AtOnce(Trainer):
  def __init__(self, *a, **kw):
    super().__init__(*a, **kw)
    self.read_metrics_late = False


def test_metrics_read_at_once_equal_read_late(tmp_path):
  keys = (*MESH_1, "steps=5", "checkpoint_period=2", "per_device_batch_size=2")
  rows = {}
  for name, cls in (("late", Trainer), ("at_once", AtOnce)):
    code, trainer = run(argv(tmp_path, name, *keys), devices=jax.devices()[:1], trainer_class=cls)
    assert code == 0 and trainer.read_metrics_late == (cls is Trainer)
    rows[name] = read_metrics(tmp_path / name)
  assert [r["step"] for r in rows["late"]] == [r["step"] for r in rows["at_once"]] == [1, 2, 3, 4, 5]
  for a, b in zip(rows["late"], rows["at_once"]):
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
