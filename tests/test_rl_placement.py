"""`rollout_placement` (MaxText/rl/placement.py): a seeded GRPO run with the engine on devices of
its own, the weights shipped by the refit stream after each update (`separate`: 4 devices train,
4 sample), gives the rewards and losses of the run with the engine on the training mesh
(`colocated` on the same 4 training devices), bit for bit; the shipping time is a metric; a
split that cannot be is refused (exit 2). Colocated with `rollout_offload`, the optimizer state
leaves the devices while the engine samples."""
import gc
import math
import os

import jax
import numpy as np

from conftest import argv, read_metrics
from grpo_helpers import write_prompts
from test_grpo import GRPO_YML, TINY
from MaxText.decoding.engine import Engine
from MaxText.rl.grpo import GRPOTrainer
from MaxText.rl.policy import Policy
from MaxText.train.loop import run


def grpo(out, name, devices, *overrides):
  code, trainer = run(argv(out, name, *overrides, config=GRPO_YML, model=TINY), devices=devices,
                      trainer_class=GRPOTrainer)
  path = os.path.join(str(out), name)
  rows = [r for r in read_metrics(path) if "reward_mean" in r] if code == 0 else []
  return code, rows, trainer


def device_bytes(arrays) -> int:
  """Bytes the arrays hold on their devices (every device's shard, replicas included)."""
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
             * len(x.sharding.device_set)
             for x in arrays if isinstance(x, jax.Array) and not x.is_deleted())


def test_separate_equals_colocated(tmp_path, monkeypatch):
  """Colocated with `rollout_offload=true`: while the engine samples, the optimizer state is host
  memory and the devices hold exactly its bytes less (jax.live_arrays); the rewards and losses
  are those of separate (so offloading changed nothing)."""
  prompts = write_prompts(tmp_path / "p.jsonl")
  keys = (f"prompts={prompts}", "reward=grpo_helpers:digits", "steps=3",
          f"eval_prompts={prompts}", "checkpoint_period=3")
  freed, sampled, holder = [], [], []
  real_offload, real_generate = Policy.offload, Engine.generate

  def offload(self, params=False):
    jax.block_until_ready(self.state)   # the update in flight done (its donated inputs gone)
    gc.collect()
    opt = device_bytes(jax.tree.leaves(self.state["opt_state"]))
    before = device_bytes(jax.live_arrays())
    real_offload(self, params)
    freed.append((before - device_bytes(jax.live_arrays()), opt))
    holder[:] = [self]

  def generate(self, *args, **kwargs):
    if holder:
      sampled.append(all(isinstance(x, np.ndarray)
                         for x in jax.tree.leaves(holder[0].state["opt_state"])))
    return real_generate(self, *args, **kwargs)

  monkeypatch.setattr(Policy, "offload", offload)
  monkeypatch.setattr(Engine, "generate", generate)
  code, colocated, _ = grpo(tmp_path, "colocated", jax.devices()[:4], *keys,
                            "rollout_offload=true")
  monkeypatch.undo()
  assert code == 0
  assert len(freed) == 3 and all(got == opt > 0 for got, opt in freed), freed
  # the 3 rollouts with the optimizer state off the devices; then the evaluation after step 3
  assert sampled[:3] == [True, True, True], sampled
  code, separate, trainer = grpo(tmp_path, "separate", None, *keys, "rollout_placement=separate")
  assert code == 0
  engine_devices = set(trainer.engine.mesh.devices.flat)
  assert not engine_devices & set(trainer.mesh.devices.flat) and len(engine_devices) == 4
  assert [r["step"] for r in separate] == [1, 2, 3]
  for a, b in zip(colocated, separate):
    for k in ("reward_mean", "reward_std", "loss", "kl", "grad_norm"):
      assert a[k] == b[k], (a["step"], k, a[k], b[k])
    assert b["weight_shipping_s"] > 0 and "weight_shipping_s" not in a
  assert len({r["reward_mean"] for r in separate}) > 1 and separate[-1]["kl"] > 0
  evals = [[r["eval_reward"] for r in read_metrics(tmp_path / n) if "eval_reward" in r]
           for n in ("colocated", "separate")]
  assert evals[0] == evals[1] and len(evals[0]) == 2


def test_an_odd_split_is_refused(tmp_path, capsys):
  prompts = write_prompts(tmp_path / "p.jsonl")
  code, _, _ = grpo(tmp_path, "odd", jax.devices()[:3], f"prompts={prompts}",
                    "reward=grpo_helpers:digits", "rollout_placement=separate")
  assert code == 2
  assert "rollout_placement=separate splits the devices in two halves" in capsys.readouterr().err
