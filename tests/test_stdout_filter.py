"""`runtime/stdout_filter.py`: lines a C++ library writes to fd 1 with a known prefix are dropped,
everything else (Python prints, other fd-1 writes) comes through in order."""
import subprocess
import sys

from conftest import ROOT

CHILD = """
import os
from MaxText.runtime.stdout_filter import GLOO
print("before", flush=True)
GLOO.start()
print("python line 1", flush=True)
os.write(1, b"[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\\n")
os.write(1, b"c++ line\\n")
os.write(1, b"[Gloo] Rank 1 is connected to 1 peer ranks. ")    # std::cout in pieces, and
print("python line 2", flush=True)                               # a print between them
os.write(1, b"Expected number of connected peer ranks is : 1\\n")
print("", flush=True)                                            # an empty line is kept
GLOO.stop()
print("after", flush=True)
"""


def test_gloo_lines_are_dropped_and_the_rest_kept_in_order():
  out = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True,
                       check=True).stdout
  assert out.splitlines() == ["before", "python line 1", "c++ line", "python line 2", "",
                              "after"]
