"""A failed async save leaves no writer behind once it is reported, and the step can be saved again.

Orbax waits for a step's item writes one after another (items sorted by name: `manifest` before
`opt_state` / `params`) and stops at the first that fails; the array items' writes then went on
unwaited while the trainer reported the failure and exited 4, racing the next run's clean-up of
the temporary directory (`Directory not empty: 'params.orbax-checkpoint-tmp'`) or its own save
of that step. Here the params write is held back until the manifest's write has failed and the
failure was reported (bounded, so that a fixed manager, which waits for it, still ends)."""
import errno
import os
import threading
import concurrent.futures

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from MaxText.checkpoint.errors import CheckpointError
from MaxText.checkpoint.manager import RunCheckpoints

HOLD_S = 5.0   # how long the held-back write waits for the report before it ends anyway


class FailStep:
  """Save hooks: step `step`'s manifest write fails (as `save_error:<step>` does)."""

  def __init__(self, step):
    self.step, self.failed = step, threading.Event()

  def during_save_write(self, step):
    if step == self.step:
      self.failed.set()
      raise OSError(errno.ENOSPC, "No space left on device (test)")

  def before_commit(self, step):
    pass


def _state(seed):
  rng = np.random.default_rng(seed)
  return {"params": {"w": jnp.asarray(rng.normal(size=(32, 16)), jnp.float32)},
          "opt_state": {"mu": jnp.asarray(rng.normal(size=(16,)), jnp.float32)}}


def test_failed_save_waits_for_its_other_writes_and_the_step_saves_again(tmp_path, monkeypatch):
  hooks = FailStep(4)
  reported = threading.Event()
  late = {"ended": threading.Event(), "dirs": []}
  pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="held_back_write")
  original = ocp.StandardCheckpointHandler.async_save

  def held_back(write_dir):
    hooks.failed.wait(60)      # the manifest's write has failed ...
    reported.wait(HOLD_S)      # ... and (without the fix) the failure is reported meanwhile
    (write_dir / "late_write").write_text("written after the manifest failed")
    late["ended"].set()

  async def async_save(self, directory, *args, **kwargs):
    futures = list(await original(self, directory, *args, **kwargs) or [])
    if directory.parent.name.startswith("4.") and directory.name.startswith("params"):
      late["dirs"].append(directory)
      futures.append(pool.submit(held_back, directory))
    return futures

  monkeypatch.setattr(ocp.StandardCheckpointHandler, "async_save", async_save)
  ckpt_dir = str(tmp_path / "checkpoints")
  ckpts = RunCheckpoints(ckpt_dir, max_to_keep=3, async_save=True, save_timeout_s=60,
                         save_hooks=hooks)
  ckpts.save(2, _state(2), None, {})
  ckpts.wait()
  ckpts.save(4, _state(4), None, {})
  with pytest.raises(CheckpointError, match="saving checkpoint step 4 failed: OSError"):
    ckpts.wait()
  # the report came only after the step's other writes ended: none still writes into step 4
  assert late["ended"].is_set(), "the failure was reported while the params write still ran"
  reported.set()
  ckpts.abandon()
  pool.shutdown(wait=True)
  assert ckpts.all_steps() == [2]

  # a new manager (the next run) clears the temporary directory and saves step 4 afresh
  monkeypatch.setattr(ocp.StandardCheckpointHandler, "async_save", original)
  again = RunCheckpoints(ckpt_dir, max_to_keep=3, async_save=True, save_timeout_s=60)
  state = _state(44)
  again.save(4, state, None, {})
  again.wait()
  assert again.all_steps() == [2, 4]
  assert sorted(os.listdir(ckpt_dir)) == ["2", "4"]   # the failed attempt's directory is gone
  assert not os.path.exists(os.path.join(ckpt_dir, "4", "params", "late_write"))
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                          {**state, "step": jnp.int32(0)})
  restored, _ = again.restore(4, abstract, None)
  for a, b in zip(jax.tree.leaves(restored["params"]), jax.tree.leaves(state["params"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  again.close()
