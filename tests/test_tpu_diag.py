"""The chip's precision diagnostics (docs/performance.md, "Where float32 differs on the chip") run
on a CPU as documented there, with the CPU in the chip's place: their JSON rows come out, and the
gradient comparison of a backend with itself is exact (both sides get the same parameters and
batch)."""
import json
import os
import subprocess
import sys

from conftest import ROOT


def _run(*args):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_precision_rows():
  rows = {r["check"]: r for r in _run("benchmarks/tpu_diag_precision.py")}
  assert rows["xla dot"]["rel"] < 1e-6                        # a CPU's float32 dot is float32
  assert rows["elementwise exp"]["tpu_vs_cpu_max_rel"] == 0   # the same backend twice
  # the derivative rows: the non-cancelling tanh beats autodiff's where the derivative matters
  assert (rows["derivative stable tanh'"]["max_rel_where_above_1em3"]
          < rows["derivative tanh'"]["max_rel_where_above_1em3"] / 30)


def test_gradient_comparison_of_a_backend_with_itself_is_exact():
  (row,) = _run("benchmarks/tpu_diag_grads.py", "model_name=qwen3-tiny")
  assert row["variant"] == "model_name=qwen3-tiny" and row["loss_rel"] == 0
  assert len(row["worst_leaves"]) == 10 and all(err == 0 for _, err in row["worst_leaves"])
