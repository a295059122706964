"""`benchmarks/gpu_suite.sh --dry-run` (the CI check of the GPU suite; no GPU needed): it lists the
six steps, every file it runs exists, the MFU model it trains is a valid ~1B config, and it times
that model on both hot paths."""
import math
import os
import re
import subprocess

import jax

from conftest import ROOT
from MaxText.config.load import load_config
from MaxText.models.model_config import ModelConfig
from MaxText.models.registry import make_model_def


def dry_run():
  p = subprocess.run(["bash", "benchmarks/gpu_suite.sh", "--dry-run", "--out", "x.md"], cwd=ROOT,
                     capture_output=True, text=True, check=False)
  assert p.returncode == 0, p.stderr
  assert not os.path.exists(os.path.join(ROOT, "x.md"))          # nothing written in a dry run
  return p.stdout


def test_dry_run_lists_the_six_steps_and_their_files_exist():
  out = dry_run()
  titles = re.findall(r"^\[dry-run\] (\d)\. ", out, re.M)
  assert titles == ["1", "2", "3", "4", "5", "6"], out
  assert "JAX_PLATFORMS=cuda" in out.splitlines()[1]            # kernels compiled, not interpreted
  for path in ("tests/test_flash_attention.py", "benchmarks/attention.py", "benchmarks/moe.py",
               "benchmarks/decode.py", "train.py", "configs/models/qwen3-1.7b.yml"):
    assert os.path.exists(os.path.join(ROOT, path)), path
  assert "--seqs 1024,2048,4096,8192,16384,32768" in out


def test_the_mfu_model_is_a_valid_1b_qwen3_shaped_config():
  line = next(l for l in dry_run().splitlines() if l.startswith("[dry-run] 3."))
  keys = [w for w in line.split(" (limit")[0].split() if "=" in w and not w.startswith("base_output")]
  cfg = load_config([os.path.join(ROOT, "configs/base.yml"), *keys])
  assert (cfg.max_target_length, cfg.dtype, cfg.hf_model_type) == (4096, "bfloat16", "qwen3")
  params = make_model_def(ModelConfig.from_config(cfg)).abstract_params
  n = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
  assert 0.9e9 < n < 1.3e9, n


def test_the_mfu_model_runs_on_both_hot_paths():
  """Step 3 trains it on the plain path (the GPU default), step 4 the same run on the tuned one."""
  lines = {l.split(".")[0][-1]: l for l in dry_run().splitlines() if l.startswith("[dry-run] ")
           and l[10].isdigit()}
  keys = lambda step: [w for w in lines[step].split(" (limit")[0].split() if "=" in w
                       and not w.startswith(("base_output", "run_name", "hot_path"))]
  assert keys("3") == keys("4")
  assert " hot_path=plain " in lines["3"] and " hot_path=tuned " in lines["4"]
  names = [re.search(r"run_name=(\S+)", lines[s]).group(1) for s in ("3", "4")]
  assert names[0] != names[1], names
