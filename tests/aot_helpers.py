"""The deviceless TPU compiles' documented commands (benchmarks/tpu_aot.sh: libtpu compiling for a
v5e on this CPU), run exactly as docs/performance.md gives them, where libtpu's wheel has been
downloaded into .libtpu-aot/ (CI has not: the tests skip)."""
import glob
import os
import shlex
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

needs_libtpu = pytest.mark.skipif(
    not glob.glob(os.path.join(ROOT, ".libtpu-aot", "*", "libtpu", "libtpu.so")),
    reason="libtpu's wheel not downloaded into .libtpu-aot/ (tpu_aot.sh does it)")


def documented_command(prefix: str, contains: str = "") -> str:
  """The first line of docs/performance.md starting with `prefix` (and holding `contains`)."""
  text = open(os.path.join(ROOT, "docs", "performance.md"), encoding="utf-8").read()
  return next(line for line in text.splitlines() if line.startswith(prefix) and contains in line)


def run_documented(command: str) -> subprocess.CompletedProcess:
  """`command` from the repository root, as a user's shell would (a second libtpu process
  allowed: another test or compile may hold libtpu's lock), its output captured."""
  env = {**os.environ, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "XLA_FLAGS": "", "JAX_PLATFORMS": ""}
  return subprocess.run(shlex.split(command), cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=600)
