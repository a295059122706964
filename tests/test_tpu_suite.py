"""benchmarks/tpu_suite.sh on a CPU (no TPU, nothing run): its dry run prints the lane's stages in
order — the `tpu` tests, the start-up run, MaxText's two rows, our step matrix — and what each
would run is valid before device time is spent on it: our start-up command and every variant of
our matrix load as configs and pass our memory pre-flight evaluated for one v5e (15.75 GiB, what
the chip ran them in), the two sides' rows have the same shapes, and MaxText's keys exist in its
0.2.5 base.yml (when its wheel is in .whl-tpu/maxtext/: skipped without)."""
import dataclasses
import os
import shlex
import subprocess
import sys

import jax
import pytest
import yaml

from conftest import BASE_YML, MESH_1, ROOT
from MaxText.config.load import load_config
from MaxText.train import memory
from MaxText.train.loop import Trainer
from test_tpu_families import TPU_LIMIT, _maxtext_configs


def dry_run(tmp_path, **env) -> list[list[str]]:
  out = tmp_path / "out"
  p = subprocess.run(["bash", "benchmarks/tpu_suite.sh", "--dry-run"], cwd=ROOT, text=True,
                     capture_output=True, check=False,
                     env={**os.environ, "TPU_SUITE_OUT": str(out), **env})
  assert p.returncode == 0, p.stderr
  assert not out.exists()
  lines = [ln for ln in p.stdout.splitlines() if ln.startswith("[dry-run] ")]
  assert lines[-1] == f"[dry-run] would write {out}/tpu_suite.md"
  return [shlex.split(ln[len("[dry-run] "):]) for ln in lines[:-1]]


def _keys(words):
  return [w for w in words if "=" in w and not w.startswith("-")]


def _stages(commands):
  return [("tests" if "pytest" in c else "start-up" if "train.py" in c else
           "maxtext" if "maxtext" in c else "ours" if "benchmarks/tpu_step.py" in c else c[0])
          for c in commands]


def test_the_stages_in_order(tmp_path):
  full, quick = dry_run(tmp_path), dry_run(tmp_path, TPU_SUITE_QUICK="1")
  assert _stages(full) == ["tests", "start-up", "start-up", "maxtext", "maxtext", "ours"]
  assert _stages(quick) == ["tests", "start-up", "start-up", "maxtext", "ours"]
  assert "tests/test_tpu.py" in full[0] and "-k" not in full[0] and "-k" in quick[0]
  ours = full[-1]
  assert ours.count("--variant") == 3 and quick[-1].count("--variant") == 1


def _our_runs(tmp_path):
  """(label, keys) of the start-up run and of each variant of our matrix."""
  commands = dry_run(tmp_path)
  startup = commands[1]
  runs = [("start-up", _keys(startup[startup.index("configs/base.yml") + 1:]))]
  matrix = commands[-1]
  base = matrix[matrix.index("--base") + 1].split()
  for i, word in enumerate(matrix):
    if word == "--variant":
      label, keys = matrix[i + 1].split(": ", 1)
      runs.append((label, [*base, *keys.split()]))
  return runs


def test_our_runs_load_and_the_v5e_pre_flight_lets_them_run(tmp_path):
  for label, keys in _our_runs(tmp_path):
    keys = [k for k in keys if not k.startswith(("base_output_directory=", "jax_cache_dir="))]
    # attention=flash: what `auto` resolves to on the chip (splash; on a CPU the XLA attention)
    cfg = load_config([BASE_YML, *MESH_1, f"base_output_directory={tmp_path}", "attention=flash",
                       *keys], keep_auto=True)
    trainer = Trainer(cfg, jax.devices()[:1])
    est = dataclasses.replace(trainer.estimate_with(), available=TPU_LIMIT,
                              runtime=memory.RUNTIME_ALLOWANCE_ACCELERATOR, platform="tpu")
    assert memory.check_fits(est) is None, (label, memory.check_fits(est))


def test_maxtexts_rows_match_ours_and_its_keys_exist(tmp_path):
  commands = dry_run(tmp_path)
  ours = dict(k.split("=", 1) for k in _keys(commands[1]))
  for row in (commands[3], commands[4]):
    theirs = dict(k.split("=", 1) for k in _keys(row))
    for key in ("model_name", "max_target_length", "per_device_batch_size"):
      assert theirs[key] == ours[key], (key, theirs[key], ours[key])
    assert theirs["sa_block_q"] == ours["flash_block_q"]
    assert theirs["sa_use_fused_bwd_kernel"] == ours["flash_fused_bwd"] == "true"
  with _maxtext_configs() as z:
    base = yaml.safe_load(z.read("maxtext/configs/base.yml"))
  for row in (commands[3], commands[4]):
    unknown = sorted(k.split("=", 1)[0] for k in _keys(row) if k.split("=", 1)[0] not in base)
    assert not unknown, unknown


if __name__ == "__main__":   # pragma: no cover
  pytest.main([__file__])


def test_tpu_test_families_picks_the_families_a_short_chip_call_runs():
  """`TPU_TEST_FAMILIES="llama qwen3-moe"` (docs/performance.md): tests/test_tpu.py's three-step
  test over those families only (collected here; it runs on the chip)."""
  env = {**os.environ, "TPU_TEST_FAMILIES": "llama qwen3-moe"}
  p = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-m", "tpu",
                      "-p", "no:cacheprovider", "tests/test_tpu.py", "-k", "three_steps"],
                     cwd=ROOT, env=env, capture_output=True, text=True, check=False)
  assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
  ids = [line for line in p.stdout.splitlines() if "three_steps" in line]
  assert [i.rsplit("[", 1)[-1] for i in ids] == ["llama]", "qwen3-moe]"], ids
