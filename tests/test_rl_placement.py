"""`rollout_placement` (MaxText/rl/placement.py): a seeded GRPO run with the engine on devices of
its own, the weights shipped by the refit stream after each update (`separate`: 4 devices train,
4 sample), gives the rewards and losses of the run with the engine on the training mesh
(`colocated` on the same 4 training devices), bit for bit; the shipping time is a metric; a
split that cannot be is refused (exit 2)."""
import os

import jax

from conftest import read_metrics
from grpo_helpers import write_prompts
from test_grpo import GRPO_YML, TINY
from MaxText.rl.grpo import GRPOTrainer
from MaxText.train.loop import run


def grpo(out, name, devices, *overrides):
  merged = dict(kv.split("=", 1) for kv in [*TINY, f"base_output_directory={out}",
                                            f"run_name={name}", *overrides])
  code, trainer = run([GRPO_YML, *(f"{k}={v}" for k, v in merged.items())], devices=devices,
                      trainer_class=GRPOTrainer)
  path = os.path.join(str(out), name)
  rows = [r for r in read_metrics(path) if "reward_mean" in r] if code == 0 else []
  return code, rows, trainer


def test_separate_equals_colocated(tmp_path):
  prompts = write_prompts(tmp_path / "p.jsonl")
  keys = (f"prompts={prompts}", "reward=grpo_helpers:digits", "steps=3",
          f"eval_prompts={prompts}", "checkpoint_period=3")
  code, colocated, _ = grpo(tmp_path, "colocated", jax.devices()[:4], *keys)
  assert code == 0
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
