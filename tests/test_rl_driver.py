"""An outside loop on the policy API (end_to_end/rl_driver.py: MaxText.rl.policy, the decoding
engine and a reward, nothing else of MaxText) reproduces `MaxText.rl.grpo` bit for bit on the
README's toy task (its prompt file and model shape), in this process on 8 fake devices: the same
rewards, losses, KL and gradient norms over 3 steps. The model starts from a random init, which
answers no sum: the toy task's `exact_answer` would pay 0 everywhere (every advantage 0), so the
reward here is a dense one (the share of digits) and a KL term makes every loss non-trivial.
Also: the optimizer state offloaded while the engine samples changes nothing; SIGTERM to the
driver (its main(), in this process) saves the step and exits 42, and a rerun resumes from it to
the same rows."""
import ast
import importlib.util
import json
import os
import signal
import sys

import pytest

from conftest import CACHE_DIR, ROOT
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


def test_sigterm_saves_exits_42_and_a_rerun_resumes(grpo_rows, tmp_path, monkeypatch, capsys):
  """The script's main() on its command line (`--offload` first, as docs/rl.md gives it), in this
  process: a SIGTERM to the process (sent by the first update, so it arrives during step 1; the
  handler is the process's own, here as in the script's process) lets the step finish, saves it and
  main() returns 42, the script's exit status (`sys.exit(main())`); a rerun of the same command
  line resumes from that checkpoint to the rows of GRPO's run above."""
  driver = _module(SCRIPT, "rl_driver")
  train, sent = driver.Policy.train, []

  def train_then_signal(self, batch):
    out = train(self, batch)
    if not sent:
      sent.append(os.getpid())
      os.kill(os.getpid(), signal.SIGTERM)
    return out
  monkeypatch.setattr(driver.Policy, "train", train_then_signal)
  cmd = [GRPO_YML, *keys(tmp_path), "run_name=driver"]
  monkeypatch.setattr(sys, "argv", [SCRIPT, "--offload", *cmd])
  assert driver.main() == 42
  out, err = capsys.readouterr()
  rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
  saved = rows[-1]["step"]
  assert saved == 1 and f"step {saved} saved; exit 42" in err, err[-3000:]
  assert os.path.isdir(tmp_path / "driver" / "checkpoints" / str(saved))
  # the rerun: the same command line, without the signal (its exit status and rows are run()'s)
  monkeypatch.setattr(driver.Policy, "train", train)
  code, again = driver.run(cmd, on_step=lambda line: None)
  assert code == 0
  rows += again
  # the same numbers as GRPO's run in this process (8 devices there and here)
  for got, want in zip(rows, grpo_rows):
    for k in ("reward_mean", "loss", "kl"):
      assert abs(got[k] - want[k]) <= 1e-6 * max(1.0, abs(want[k])), (got["step"], k)
  assert [r["step"] for r in rows] == [1, 2, 3]
