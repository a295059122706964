"""benchmarks/compile_time.py's `--kernels` count: the LLVM modules XLA:CPU logs while the train
step's compile runs, and none of another program's (init's before it, a later one after), read
from a probe's events and XLA's glog lines written the way they are (local time, no year). No jax:
synthetic files, milliseconds."""
import datetime
import json
import os
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import compile_time  # noqa: E402


def _glog(t: float, module: str) -> str:
  d = datetime.datetime.fromtimestamp(t)
  return (f"I{d:%m%d %H:%M:%S}.{d.microsecond:06d}   31546 ir_compiler.cc:293] Compiled LLVM "
          f"module: __compute_module_{module}_kernel_module time: 20.1 ms (20100 us)\n")


def _events(path, step_name: str, start: float, end: float) -> None:
  rows = [{"event": "compile", "name": "jit(init)", "s": 1.0, "t": start - 5.0, "cpu": 1.0},
          {"event": "lower", "name": step_name, "s": 0.2, "t": start - 0.1, "cpu": 2.0},
          {"event": "compile", "name": step_name, "s": end - start, "t": end, "cpu": 5.0}]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("trainer,step_name", [("ours", "jit(step)"), ("maxtext", "jit(train_step)")])
def test_counts_the_step_compiles_kernels_only(tmp_path, trainer, step_name):
  start = datetime.datetime(2026, 12, 5, 1, 12, 45, 500000).timestamp()
  end = start + 14.75
  _events(tmp_path / "run.events", step_name, start, end)
  lines = [_glog(start - 6.0, "init_fusion")]                        # init's kernels: before
  lines += [_glog(start + 0.01 + i * 0.5, f"add_select_fusion.{i}") for i in range(7)]
  lines.append("I1205 01:12:50.000000   31546 fusion_compiler.cc:494] Compiled MLIR module: x\n")
  lines.append(_glog(end + 2.0, "metrics_fusion"))                   # a later program: after
  (tmp_path / "run.log").write_text("".join(lines))
  assert compile_time.step_kernels(str(tmp_path / "run.events"), str(tmp_path / "run.log"),
                                   trainer) == 7


def test_a_run_without_the_step_compile_is_an_error(tmp_path):
  (tmp_path / "run.events").write_text(json.dumps(
      {"event": "compile", "name": "jit(init)", "s": 1.0, "t": 10.0, "cpu": 1.0}) + "\n")
  (tmp_path / "run.log").write_text("")
  with pytest.raises(RuntimeError, match="no compile event of 'step'"):
    compile_time.step_kernels(str(tmp_path / "run.events"), str(tmp_path / "run.log"), "ours")
