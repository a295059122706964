"""The package is installed (setup.sh: `pip install --no-deps -e .` of pyproject.toml): the venv's
python imports MaxText's Python API from any directory, and it is this checkout's MaxText."""
import os
import subprocess
import sys

import pytest

from conftest import ROOT


def test_maxtext_imports_from_another_directory(tmp_path):
  checkout = os.path.dirname(os.path.realpath(sys.prefix))   # setup.sh's venv is <checkout>/.venv
  if not os.path.isfile(os.path.join(checkout, "setup.sh")):
    pytest.skip(f"this python's environment ({sys.prefix}) is not a checkout's .venv of setup.sh")
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  done = subprocess.run(
      [sys.executable, "-c", "import os, MaxText\nfrom MaxText import inference, inspect\n"
       "print(os.path.realpath(os.path.dirname(MaxText.__file__)))"],
      cwd=tmp_path, env=env, capture_output=True, text=True, check=False)
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.strip().splitlines()[-1] == os.path.join(checkout, "MaxText")
  assert os.path.isfile(os.path.join(ROOT, "pyproject.toml"))   # what setup.sh installs
