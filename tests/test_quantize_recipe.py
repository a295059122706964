"""The quantization recipe of the docs (docs/quantization.md, else README.md) as written, through
the real command lines in subprocesses, in a folder laid out like a fresh clone (its `configs/`
and `train.py`, this checkout's package): train a run that holds out a share, quantize it to int8
(RTN) and int4 (GPTQ), evaluate the float and the int4 checkpoints on the held-out share, decode
both quantized ones. Only the training command gets more keys: a tiny model, two steps, no sample
after them (a decode's programs the recipe's own decodes, on the quantized weights, never reuse).

A quantized checkpoint's config carries the dataset keys and held-out share of the run that
trained its weights, not those of the quantize command, so the held-out checks of
`MaxText.evaluate` see that run (`resolve/held_out.py: trained_on`)."""
import math
import os
import re
import shlex
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import CACHE_DIR, ROOT, tool_home, xla_flags
from MaxText.checkpoint.manager import load_params, read_meta
from MaxText.config.load import load_config
from MaxText.resolve import held_out

TINY_RUN = ["steps=2", "emb_dim=64", "num_decoder_layers=2", "num_query_heads=4", "num_kv_heads=2",
            "head_dim=16", "mlp_dim=128", "max_target_length=64", "per_device_batch_size=2",
            "enable_tensorboard=false", "peak_tflops_per_device=1.0", "sample_at_end=false",
            f"jax_cache_dir={CACHE_DIR}"]
PYTHONS = (".venv/bin/python", "python3", "python")


def recipe_commands() -> tuple[str, list[list[str]]]:
  """(the file, the commands) of the first bash block there that runs MaxText.quantize."""
  for rel in ("docs/quantization.md", "README.md"):
    path = os.path.join(ROOT, rel)
    if not os.path.isfile(path):
      continue
    with open(path, encoding="utf-8") as f:
      text = f.read()
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
      if "MaxText.quantize" in block:
        lines = block.replace("\\\n", " ").splitlines()
        return rel, [shlex.split(line) for line in lines if line.strip()]
  raise AssertionError("no bash block with MaxText.quantize in docs/quantization.md or README.md")


@pytest.mark.timeout(3600)   # a tool process per command, each compiling: over pytest.ini's limit
def test_the_documented_quantize_recipe_runs_as_written(tmp_path):
  rel, commands = recipe_commands()
  assert [c[1] if c[1] != "-m" else c[2] for c in commands][:3] == \
      ["train.py", "MaxText.quantize", "MaxText.quantize"], (rel, commands)
  clone = tmp_path / "clone"
  clone.mkdir()
  os.symlink(os.path.join(ROOT, "configs"), clone / "configs")
  os.symlink(os.path.join(ROOT, "train.py"), clone / "train.py")
  # a plain process: no fake devices (this test process's device count; JAX_PLATFORMS=cpu: one
  # device), the suite's compile flags (tests/conftest.py: xla_flags), this checkout's package, a
  # HOME whose ~/.cache/maxtext_jax is the suite's cache (the tools after train.py keep base.yml's)
  env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
  env.update(PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(None),
             HOME=tool_home(tmp_path))
  outputs = []
  for command in commands:
    assert command[0] in PYTHONS, (rel, command)
    argv = [sys.executable, *command[1:]] + (TINY_RUN if command[1] == "train.py" else [])
    done = subprocess.run(argv, cwd=clone, env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, (rel, command, done.stdout[-2000:], done.stderr[-3000:])
    outputs.append((done.stdout, done.stderr))
  by_tool = lambda tool: [out for c, (out, _) in zip(commands, outputs) if tool in c]
  quantized = by_tool("MaxText.quantize")
  assert "wrote q8: rtn int8" in quantized[0] and "wrote q4: gptq int4" in quantized[1], quantized
  run = next(a.split("=", 1)[1] for a in commands[1] if a.startswith("load_parameters_path="))
  share = float(next(a.split("=", 1)[1] for a in commands[0]
                     if a.startswith("eval_split_fraction=")))
  assert share > 0   # the evaluations measure the quantization on text the run never read

  # the integer checkpoints: int8 levels; int4 packed two per uint8; the run's held-out share
  for name, dtype in (("q8", np.int8), ("q4", np.uint8)):
    leaves = jax.tree.leaves(load_params(str(clone / name), None))
    assert any(x.dtype == dtype for x in leaves), (name, {x.dtype for x in leaves})
    config = read_meta(str(clone / name))["config"]
    assert config["eval_split_fraction"] == share, (name, config["eval_split_fraction"])
    assert config["eval_split_fraction"] == read_meta(str(clone / run))["config"][
        "eval_split_fraction"]
    # evaluating it on the run's held-out share is what the run's own checkpoint allows
    cfg = load_config([os.path.join(ROOT, "configs", "base.yml"),
                       f"load_parameters_path={clone / name}", f"eval_split_fraction={share:g}"])
    assert held_out.run_share(cfg) == share
    held_out.check_evaluation(cfg)

  losses = [float(re.search(r"^eval_loss=(\S+) ", o, flags=re.M).group(1))
            for o in by_tool("MaxText.evaluate")]
  assert len(losses) >= 1 and all(math.isfinite(x) for x in losses), losses
  decoded = [(out, err) for c, (out, err) in zip(commands, outputs) if "MaxText.decode" in c]
  assert [c for c in commands if "MaxText.decode" in c and "load_parameters_path=q8" in c]
  for out, err in decoded:   # the continuation on stdout, the header and the count on stderr
    assert out and re.search(r"^[1-9]\d* tokens in ", err, flags=re.M), (out, err[-2000:])
