"""A step whose loss or gradient is NaN/Inf is never applied; `halt` exits 5 without a new
checkpoint, `skip` goes on up to `max_nonfinite_skips`. Every committed checkpoint is finite."""
import os

import jax
import numpy as np
import orbax.checkpoint as ocp

from conftest import MESH_1, train

# lr 1e30 from step 0: step 1 (computed on the initial params) is finite and drives the parameters
# to ~1e30, so from step 2 on the logits overflow and the loss is non-finite.
DIVERGE = ("steps=6", "learning_rate=1e30", "warmup_steps=0", "lr_schedule=constant",
           "max_grad_norm=0", "weight_decay=0", "checkpoint_period=1", "max_checkpoints_to_keep=10",
           "async_checkpointing=false", *MESH_1)


def _all_finite(ckpt_dir):
  for step in sorted(os.listdir(ckpt_dir)):
    with ocp.StandardCheckpointer() as c:
      for item in ("params", "opt_state"):
        tree = c.restore(os.path.join(ckpt_dir, step, item))
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(tree)), (step, item)


def test_halt_exits_5_and_saves_nothing_new(tmp_path):
  code, rows, _ = train(tmp_path, "halt", *DIVERGE, devices=jax.devices()[:1])
  assert code == 5
  assert [r["finite"] for r in rows] == [1.0, 0.0]
  assert rows[1]["loss"] is None or not np.isfinite(rows[1]["loss"])
  ckpt = tmp_path / "halt" / "checkpoints"
  assert sorted(os.listdir(ckpt)) == ["1"]
  _all_finite(ckpt)


def test_skip_goes_on_until_the_limit(tmp_path):
  code, rows, _ = train(tmp_path, "skip", *DIVERGE, "nonfinite_policy=skip",
                        "max_nonfinite_skips=2", devices=jax.devices()[:1])
  assert code == 5
  assert [r["finite"] for r in rows] == [1.0, 0.0, 0.0, 0.0]
  ckpt = tmp_path / "skip" / "checkpoints"
  # steps 2 and 3 were skipped (parameters unchanged) and saved; step 4 is over the limit
  assert sorted(os.listdir(ckpt), key=int) == ["1", "2", "3"]
  _all_finite(ckpt)
  with ocp.StandardCheckpointer() as c:
    p1, p3 = (c.restore(os.path.join(ckpt, s, "params")) for s in ("1", "3"))
  for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p3)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_logged_lr_is_the_rate_applied(tmp_path):
  """Skipped steps do not advance optax's schedule, only the train state's step: the logged lr
  is the rate the optimizer uses (the schedule at optax's count), not the schedule at the step."""
  from conftest import argv
  from MaxText.config.load import load_config
  from MaxText.train.optimizer import learning_rate_schedule
  run = (*DIVERGE, "lr_schedule=cosine", "nonfinite_policy=skip", "max_nonfinite_skips=2",
         "enable_checkpointing=false")
  code, rows, _ = train(tmp_path, "lr", *run, devices=jax.devices()[:1])
  assert code == 5 and [r["finite"] for r in rows] == [1.0, 0.0, 0.0, 0.0]
  schedule = learning_rate_schedule(load_config(argv(tmp_path, "lr", *run)))
  rate = lambda count: float(np.float32(schedule(count)))
  assert len({rate(0), rate(1), rate(2), rate(3)}) == 4     # the schedule moves every step
  assert rows[0]["lr"] == rate(0)
  # steps 2-4 applied nothing: optax's count stays at 1 (the state's step went on to 3)
  assert [r["lr"] for r in rows[1:]] == [rate(1)] * 3
