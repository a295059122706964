"""benchmarks/tiny_train.py's tokens per step: exact from each row (tokens/s x its own step time),
not the product of two medians, which printed e.g. 4,097 for 4,096."""
import os
import statistics
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from tiny_train import tokens_per_step  # noqa: E402


def test_tokens_per_step_is_exact():
  step_s = [0.4, 0.6, 0.9, 1.5]        # a loaded machine's step times
  tok_s = [4096 / s for s in step_s]
  assert round(statistics.median(tok_s) * statistics.median(step_s)) == 4267   # the former figure
  assert tokens_per_step(tok_s, step_s) == 4096
  with pytest.raises(ValueError, match="disagree"):
    tokens_per_step([4096 / 0.6, 8192 / 0.6], [0.6, 0.6])
