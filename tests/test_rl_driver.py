"""An outside loop on the policy API (end_to_end/rl_driver.py: MaxText.rl.policy, the decoding
engine and a reward, nothing else of MaxText) reproduces `MaxText.rl.grpo` bit for bit on the
README's toy task (its prompt file and model shape), in this process on 8 fake devices: the same
rewards, losses, KL and gradient norms over 3 steps. The model starts from a random init, which
answers no sum: the toy task's `exact_answer` would pay 0 everywhere (every advantage 0), so the
reward here is a dense one (the share of digits) and a KL term makes every loss non-trivial."""
import ast
import importlib.util
import os

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


def test_the_driver_reproduces_grpo_bit_for_bit(tmp_path):
  toy = _module(TOY, "grpo_addition")
  keys = [*toy.MODEL, "max_target_length=16", "max_new_tokens=6",
          f"prompts={os.path.join(toy.DATA, toy.FILES['prompts'])}",
          "reward=grpo_helpers:digits", "prompts_per_step=4", "num_generations=4", "steps=3",
          "learning_rate=3e-2", "kl_beta=0.01", "dtype=float32", "enable_tensorboard=false",
          f"jax_cache_dir={CACHE_DIR}", "checkpoint_period=3", "microbatch_size=8"]
  code, rows, _ = grpo(tmp_path, "grpo", *keys)
  assert code == 0
  want = [r for r in rows if "reward_mean" in r]
  driver = _module(SCRIPT, "rl_driver")
  got = driver.run([GRPO_YML, *keys, f"base_output_directory={tmp_path}", "run_name=driver"],
                   on_step=lambda line: None)
  assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3]
  for g, w in zip(got, want):
    for k in ("reward_mean", "reward_std", "loss", "kl", "grad_norm"):
      assert g[k] == w[k], (g["step"], k, g[k], w[k])
  assert len({r["reward_mean"] for r in got}) > 1 and got[-1]["kl"] > 0   # not trivially equal
  assert os.path.isdir(tmp_path / "driver" / "checkpoints" / "3")
  assert os.path.isdir(tmp_path / "grpo" / "checkpoints" / "3")
