"""The GRPO toy task's recipe as the docs give it (`end_to_end/grpo_addition.py`, on its shipped
prompt files): the files are what the script's seeded writer makes, and the recipe's two commands
(the warm-up `train.py` run, then `MaxText.rl.grpo` from its checkpoint) run end to end on a fresh
checkout — shortened to a few steps. That the held-out reward rises over the full recipe is
tests/test_grpo.py's slow test (MAXTEXT_SLOW_TESTS=1)."""
import importlib.util
import json
import os
import subprocess
import sys

from conftest import ROOT, tool_home, xla_flags

SCRIPT = os.path.join(ROOT, "end_to_end", "grpo_addition.py")


def _script():
  spec = importlib.util.spec_from_file_location("grpo_addition", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_the_shipped_prompt_files_are_the_seeded_writers(tmp_path):
  recipe = _script()
  written = recipe.write_data(str(tmp_path))
  for key, path in written.items():
    shipped = os.path.join(recipe.DATA, recipe.FILES[key])
    with open(path, "rb") as a, open(shipped, "rb") as b:
      assert a.read() == b.read(), shipped
  with open(os.path.join(recipe.DATA, recipe.FILES["held_out"]), encoding="utf-8") as f:
    held_out = {json.loads(line)["prompt"] for line in f}
  with open(os.path.join(recipe.DATA, recipe.FILES["prompts"]), encoding="utf-8") as f:
    prompts = {json.loads(line)["prompt"] for line in f}
  assert len(held_out) == recipe.HELD_OUT and not held_out & prompts   # never trained on


def test_the_recipe_runs_end_to_end(tmp_path):
  # a plain process, as a user starts the script: one CPU device (not this process's 8 fake ones:
  # the warm-up's 16 rows per device were 128 rows a step, GRPO's 64 rows spread over 8 device
  # threads), the suite's compile flags (tests/conftest.py: xla_flags), a HOME whose
  # ~/.cache/maxtext_jax is the suite's cache (the script's commands keep base.yml's jax_cache_dir)
  env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(None), HOME=tool_home(tmp_path))
  out = subprocess.run([sys.executable, SCRIPT, "--out", str(tmp_path), "--sft-steps", "2",
                        "--grpo-steps", "1"], cwd=ROOT, env=env, capture_output=True, text=True)
  assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-2000:])
  result = json.loads(out.stdout[out.stdout.index("{"):])
  assert 0.0 <= result["eval_reward_greedy_before"] <= 1.0
  assert [step for step, _ in result["eval_curve"]] == [0, 1]   # before GRPO and after its step
  assert os.path.isdir(tmp_path / "warmup" / "checkpoints" / "2")
  assert os.path.isdir(tmp_path / "grpo" / "checkpoints" / "1")
  assert "$ " in out.stdout and "MaxText.rl.grpo" in out.stdout   # the commands, to copy
