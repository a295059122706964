"""An outside loop on the policy API (end_to_end/rl_driver.py: MaxText.rl.policy, the decoding
engine and a reward, nothing else of MaxText) reproduces `MaxText.rl.grpo` bit for bit on the
README's toy task (its prompt file and model shape), in this process on 8 fake devices: the same
rewards, losses, KL and gradient norms over 3 steps. The model starts from a random init, which
answers no sum: the toy task's `exact_answer` would pay 0 everywhere (every advantage 0), so the
reward here is a dense one (the share of digits) and a KL term makes every loss non-trivial.
Also: the optimizer state offloaded while the engine samples changes nothing; SIGTERM to the
driver saves the step and exits 42, and a rerun resumes from it to the same rows."""
import ast
import importlib.util
import json
import os
import signal
import subprocess
import sys

import pytest

from conftest import CACHE_DIR, ROOT, xla_flags
from test_grpo import GRPO_YML, grpo

SCRIPT = os.path.join(ROOT, "end_to_end", "rl_driver.py")
TOY = os.path.join(ROOT, "end_to_end", "grpo_addition.py")


def _module(path, name):
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_the_driver_imports_only_the_policy_the_engine_and_numpy():
  tree = ast.parse(open(SCRIPT, encoding="utf-8").read())
  names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
  names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
  ours = {n for n in names if n.startswith("MaxText")}
  assert ours == {"MaxText.rl.policy", "MaxText.decoding.engine", "MaxText.decoding.sampling"}


def keys(out):
  toy = _module(TOY, "grpo_addition")
  return [*toy.MODEL, "max_target_length=16", "max_new_tokens=6",
          f"prompts={os.path.join(toy.DATA, toy.FILES['prompts'])}",
          "reward=grpo_helpers:digits", "prompts_per_step=4", "num_generations=4", "steps=3",
          "learning_rate=3e-2", "kl_beta=0.01", "dtype=float32", "enable_tensorboard=false",
          f"jax_cache_dir={CACHE_DIR}", "checkpoint_period=3", "microbatch_size=8",
          f"base_output_directory={out}"]


@pytest.fixture(scope="module")
def grpo_rows(tmp_path_factory):
  out = tmp_path_factory.mktemp("grpo")
  code, rows, _ = grpo(out, "grpo", *keys(out))
  assert code == 0
  assert os.path.isdir(out / "grpo" / "checkpoints" / "3")
  return [r for r in rows if "reward_mean" in r]


def same_rows(got, want):
  assert [r["step"] for r in got] == [r["step"] for r in want]
  for g, w in zip(got, want):
    for k in ("reward_mean", "reward_std", "loss", "kl", "grad_norm"):
      assert g[k] == w[k], (g["step"], k, g[k], w[k])


@pytest.mark.parametrize("offload", [False, True])
def test_the_driver_reproduces_grpo_bit_for_bit(grpo_rows, tmp_path, offload):
  driver = _module(SCRIPT, "rl_driver")
  code, got = driver.run([GRPO_YML, *keys(tmp_path), "run_name=driver"],
                         on_step=lambda line: None, offload=offload)
  assert code == 0
  same_rows(got, grpo_rows)
  assert [r["step"] for r in got] == [1, 2, 3]
  assert len({r["reward_mean"] for r in got}) > 1 and got[-1]["kl"] > 0   # not trivially equal
  assert os.path.isdir(tmp_path / "driver" / "checkpoints" / "3")


def test_sigterm_saves_exits_42_and_a_rerun_resumes(grpo_rows, tmp_path):
  # XLA_FLAGS inherited (tests/conftest.py: 8 devices, the suite's compile flags): the driver's
  # programs are those of the in-process run above, answered by the persistent cache
  env = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu",
             XLA_FLAGS=xla_flags(8),
             PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
  assert "--xla_force_host_platform_device_count=8" in env["XLA_FLAGS"]
  cmd = [sys.executable, SCRIPT, GRPO_YML, *keys(tmp_path), "run_name=driver"]
  proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  first = ""
  while not first.startswith("{"):        # step 1 is done: the signal comes during step 2
    first = proc.stdout.readline()
    assert first, proc.stderr.read()[-3000:]
  proc.send_signal(signal.SIGTERM)
  rest, err = proc.communicate(timeout=300)
  assert proc.returncode == 42, err[-3000:]
  rows = [json.loads(line) for line in (first + rest).splitlines() if line.startswith("{")]
  saved = rows[-1]["step"]
  assert saved < 3 and f"step {saved} saved; exit 42" in err
  assert os.path.isdir(tmp_path / "driver" / "checkpoints" / str(saved))
  # the rerun: the same command line, in this process (its exit status and rows are run()'s; the
  # process boundary was the signal's point, not the resume's)
  code, again = _module(SCRIPT, "rl_driver").run(cmd[2:], on_step=lambda line: None)
  assert code == 0
  rows += again
  # the same numbers as GRPO's run in this process (8 devices there and here)
  for got, want in zip(rows, grpo_rows):
    for k in ("reward_mean", "loss", "kl"):
      assert abs(got[k] - want[k]) <= 1e-6 * max(1.0, abs(want[k])), (got["step"], k)
  assert [r["step"] for r in rows] == [1, 2, 3]
