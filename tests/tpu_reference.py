"""What the `tpu` test files share (tests/test_tpu.py, tests/test_tpu_decode.py): each measurement
written to $TPU_TEST_RECORD before its assertion (benchmarks/tpu_suite.sh sets it: a stage cut short
by its time limit still leaves what was measured), and the CPU reference — a module's function over
its FAMILIES (with its EXACT keys) in a subprocess with JAX_PLATFORMS=cpu, started when the module
is imported on the chip so that the CPU computes while the chip runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def record(test: str, **values) -> None:
  path = os.environ.get("TPU_TEST_RECORD")
  if path:
    with open(path, "a", encoding="utf-8") as f:
      f.write(json.dumps({"test": test, **values}) + "\n")


def start_cpu_reference(module: str, fn: str) -> subprocess.Popen:
  """`{name: module.fn([*keys, *module.EXACT]) for name, keys in module.FAMILIES.items()}` on the
  CPU, in a subprocess (its JSON the last line of its stdout)."""
  code = (f"import json, sys; sys.path.insert(0, {ROOT!r}); from {module} import FAMILIES, "
          f"EXACT, {fn}; print(json.dumps({{n: {fn}([*k, *EXACT]) for n, k in FAMILIES.items()}}))")
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
  return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


class CpuReference:
  """A `tpu` test module's CPU reference (`start_cpu_reference(module, fn)`): started at once when
  the module is imported on the chip (JAX_PLATFORMS naming tpu), so the CPU computes while the
  chip runs the tests before it; elsewhere when its fixture first asks. The module's fixture is
  `yield from reference.process()` (the subprocess, killed after the module if still running)."""

  def __init__(self, module: str, fn: str):
    self.module, self.fn = module, fn
    self.started = (start_cpu_reference(module, fn)
                    if "tpu" in os.environ.get("JAX_PLATFORMS", "") else None)

  def process(self):
    proc, self.started = self.started or start_cpu_reference(self.module, self.fn), None
    yield proc
    if proc.poll() is None:
      proc.kill()


_RESULTS: dict[int, dict] = {}


def cpu_result(proc: subprocess.Popen) -> dict:
  """The reference's JSON (waited for once per subprocess)."""
  if proc.pid not in _RESULTS:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, f"the CPU reference failed: {err[-3000:]}"
    _RESULTS[proc.pid] = json.loads(out.strip().splitlines()[-1])
  return _RESULTS[proc.pid]
