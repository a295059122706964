"""The GRPO loop (python -m MaxText.rl.grpo) on a tiny random model, in this process on 8 fake
devices: the reward rises (a dense "share of digits" reward, high learning rate), a run resumed
from its checkpoint ends bit for bit where the uninterrupted one did (samples and prompts are
functions of (seed, step)), bad rewards are counted up to max_bad_rewards then exit 3, and each
bad input is refused with exit 2 naming its culprit before anything compiles."""
import os
import re
import shutil

import jax
import numpy as np
import pytest

from conftest import CACHE_DIR, ROOT, read_metrics
from grpo_helpers import write_prompts
from MaxText.rl.grpo import GRPOTrainer
from MaxText.train.loop import run

GRPO_YML = os.path.join(ROOT, "configs", "grpo.yml")
TINY = ["emb_dim=32", "num_decoder_layers=1", "num_query_heads=2", "num_kv_heads=1", "head_dim=16",
        "mlp_dim=64", "vocab_size=264", "max_target_length=16", "max_new_tokens=6",
        "num_generations=4", "prompts_per_step=4", "enable_tensorboard=false",
        "peak_tflops_per_device=1.0", f"jax_cache_dir={CACHE_DIR}", "log_period=1",
        "learning_rate=3e-2", "kl_beta=0.01"]


def grpo(out, name, *overrides):
  merged = dict(kv.split("=", 1) for kv in [*TINY, f"base_output_directory={out}",
                                            f"run_name={name}", *overrides])
  code, trainer = run([GRPO_YML, *(f"{k}={v}" for k, v in merged.items())],
                      trainer_class=GRPOTrainer)
  path = os.path.join(str(out), name, "metrics.jsonl")
  rows = read_metrics(os.path.join(str(out), name)) if os.path.exists(path) else []
  return code, rows, trainer


@pytest.fixture(scope="module")
def learning_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("grpo")
  prompts = write_prompts(out / "p.jsonl")
  code, rows, trainer = grpo(out, "run", f"prompts={prompts}", "reward=grpo_helpers:digits",
                             "steps=16", "checkpoint_period=8", "max_checkpoints_to_keep=5")
  assert code == 0
  return out, prompts, [r for r in rows if "reward_mean" in r], trainer.final_state


def test_reward_rises(learning_run):
  _, _, rows, _ = learning_run
  assert [r["step"] for r in rows] == list(range(1, 17))
  first = np.mean([r["reward_mean"] for r in rows[:4]])
  last = np.mean([r["reward_mean"] for r in rows[-4:]])
  print(f"digit share: first 4 steps {first:.3f}, last 4 {last:.3f}")
  assert last > first + 0.2, (first, last)
  # on-policy (num_iterations=1): the engine's log-probabilities are the trainer's
  assert max(r["rollout_logprob_diff_max"] for r in rows) < 1e-3
  assert all(r["ratio_mean"] == pytest.approx(1.0, abs=1e-4) for r in rows)
  for key in ("kl", "clip_frac_low", "clip_frac_high", "entropy", "response_length",
              "reward_std", "reward/grpo_helpers:digits", "rollout_time_s", "train_time_s"):
    assert key in rows[-1], key
  assert rows[-1]["kl"] > 0


def test_resume_is_bitwise(learning_run, tmp_path):
  out, prompts, rows, final = learning_run
  shutil.copytree(out / "run", tmp_path / "run")
  for name in os.listdir(tmp_path / "run" / "checkpoints"):
    if name.isdigit() and int(name) > 8:
      shutil.rmtree(tmp_path / "run" / "checkpoints" / name)
  code, resumed, trainer = grpo(tmp_path, "run", f"prompts={prompts}",
                                "reward=grpo_helpers:digits", "steps=16", "checkpoint_period=8",
                                "max_checkpoints_to_keep=5")
  assert code == 0
  resumed = {r["step"]: r for r in resumed if "reward_mean" in r}
  for r in rows[8:]:
    assert resumed[r["step"]]["reward_mean"] == r["reward_mean"]
    assert resumed[r["step"]]["loss"] == r["loss"]
  for a, b in zip(jax.tree.leaves(final["params"]), jax.tree.leaves(trainer.final_state["params"])):
    assert np.array_equal(np.asarray(a), np.asarray(b))


def test_bad_rewards_are_counted_then_exit_3(tmp_path, capsys):
  prompts = write_prompts(tmp_path / "p.jsonl")
  code, rows, _ = grpo(tmp_path, "bad", f"prompts={prompts}",
                       "reward=grpo_helpers:digits,grpo_helpers:flaky", "steps=2",
                       "max_bad_rewards=10", "enable_checkpointing=false")
  err = capsys.readouterr().err
  assert code == 3, err[-2000:]
  assert "bad reward (1/10 allowed, max_bad_rewards): grpo_helpers:flaky " in err
  assert re.search(r"grpo_helpers:flaky raised ValueError: cannot score row (\d+) on \S+p.jsonl "
                   r"line (\d+)", err)
  assert "grpo_helpers:flaky returned str 'yes', not a number" in err
  assert "more than max_bad_rewards=10" in err
  assert "line" in err and "p.jsonl" in err


@pytest.mark.parametrize("overrides,expected", [
    (["num_generations=1"], "num_generations=1: GRPO's advantages are relative"),
    (["reward=no_such_package.rewards:score"], "module 'no_such_package.rewards' does not import"),
    (["reward=grpo_helpers:no_such_function"], "has no function 'no_such_function'"),
    (["reward="], "GRPO needs at least one reward function"),
    (["max_new_tokens=6", "LONG"], "line 9: the prompt has 12 tokens, more than the 10 allowed "
                                   "(max_target_length=16 - max_new_tokens=6)"),
    (["temperature=0"], "temperature=0 decodes greedily"),
])
def test_bad_input_exits_2_naming_the_culprit(tmp_path, capsys, overrides, expected):
  prompts = write_prompts(tmp_path / "p.jsonl", long_line=11 if "LONG" in overrides else None)
  overrides = [o for o in overrides if o != "LONG"]
  code, _, _ = grpo(tmp_path, "x", f"prompts={prompts}", "reward=grpo_helpers:digits", *overrides)
  err = capsys.readouterr().err
  assert code == 2, err[-2000:]
  assert expected in err, err[-2000:]


def test_two_processes_equal_one(learning_run, tmp_path):
  """2 processes x 4 fake devices (loopback, gloo) against the 1 x 8 run above: the same
  completions (rewards equal) and losses within 1e-5 over the first 3 steps."""
  import sys   # pylint: disable=import-outside-toplevel
  from MaxText.launch import local   # pylint: disable=import-outside-toplevel
  _, prompts, rows, _ = learning_run
  merged = dict(kv.split("=", 1) for kv in [*TINY, f"base_output_directory={tmp_path}",
                                            "run_name=mp", f"prompts={prompts}",
                                            "reward=grpo_helpers:digits", "steps=3",
                                            "enable_checkpointing=false"])
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
  result = local.launch([sys.executable, "-m", "MaxText.rl.grpo", GRPO_YML,
                         *(f"{k}={v}" for k, v in merged.items())], 2, devices_per_process=4,
                        log_dir=str(tmp_path / "logs"), cwd=ROOT, env=env, timeout_s=400)
  logs = "".join((tmp_path / "logs" / f"process_{i}.{s}").read_text()
                 for i in (0, 1) for s in ("out", "err"))
  assert result.status == 0, logs[-4000:]
  assert "distributed: 2 processes, 8 devices" in logs
  mp = [r for r in read_metrics(tmp_path / "mp") if "reward_mean" in r]
  assert [r["step"] for r in mp] == [1, 2, 3]
  for got, want in zip(mp, rows[:3]):
    assert got["reward_mean"] == want["reward_mean"]
    assert got["reward_std"] == want["reward_std"]
    assert abs(got["loss"] - want["loss"]) <= 1e-5, (got["loss"], want["loss"])
