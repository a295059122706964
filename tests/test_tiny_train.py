"""benchmarks/tiny_train.py: the tokens per step exact from each row (tokens/s x its own step time,
not the product of two medians, which printed e.g. 4,097 for 4,096); the order of the runs
alternating between repetitions; the matrix table's medians, spreads and ratio of medians."""
import os
import statistics
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from tiny_train import matrix_table, run_order, tokens_per_step  # noqa: E402


def test_tokens_per_step_is_exact():
  step_s = [0.4, 0.6, 0.9, 1.5]        # a loaded machine's step times
  tok_s = [4096 / s for s in step_s]
  assert round(statistics.median(tok_s) * statistics.median(step_s)) == 4267   # the former figure
  assert tokens_per_step(tok_s, step_s) == 4096
  with pytest.raises(ValueError, match="disagree"):
    tokens_per_step([4096 / 0.6, 8192 / 0.6], [0.6, 0.6])


def test_every_other_repetition_runs_in_reverse():
  cells = ["2fsdp", "2data", "4fsdp"]
  assert [run_order(cells, rep) for rep in range(3)] == [cells, cells[::-1], cells]
  kinds = ["ours", "maxtext"]
  firsts = [run_order(kinds, rep)[0] for rep in range(4)]
  assert firsts.count("ours") == firsts.count("maxtext") == 2


def test_matrix_table_medians_spread_and_ratio_of_medians():
  cell = {"devices": 2, "mesh": "fsdp", "dtype": "bfloat16"}
  run = lambda tok, cpu: {"tokens_per_s": tok, "cpu_s": cpu, "losses": [2.0, 1.0]}
  results = {("ours", 2, "fsdp", "bfloat16"): [run(4974, 0.8), run(4434, 0.9), run(4704, 0.85)],
             ("maxtext", 2, "fsdp", "bfloat16"): [run(3873, 1.0), run(4100, 1.1), run(3500, 1.2)]}
  head, rule, line = matrix_table([cell], ["ours", "maxtext"], results)
  assert head.count("|") == rule.count("|") == line.count("|")
  cols = [c.strip() for c in line.strip("|").split("|")]
  assert cols[3] == "3"
  assert cols[4] == "4,704 [4,434–4,974]" and cols[5] == "3,873 [3,500–4,100]"
  assert cols[6] == f"**{4704 / 3873:.2f}x**"     # the ratio of the medians, not a median of ratios
  assert cols[7] == "0.85 / 1.10"
  assert cols[9] == "n/a"                         # no one-device run in this matrix
