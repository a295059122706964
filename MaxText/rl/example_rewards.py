"""Example reward functions for verifiable tasks (`reward=MaxText.rl.example_rewards:NAME`), each
`f(prompt, completion, row) -> float` (MaxText/rl/rewards.py):

  exact_answer   1 when the completion's answer (its first line, stripped) is the row's "answer"
  format_check   1 when the completion's first line matches the row's "format" regex (default: an
                 integer) and nothing but whitespace follows it
"""
from __future__ import annotations

import re

INTEGER = r"-?\d+"


def answer_of(completion: str) -> str:
  """The completion's answer: its first line, stripped."""
  return completion.split("\n", 1)[0].strip()


def exact_answer(prompt: str, completion: str, row: dict) -> float:
  del prompt
  if "answer" not in row:
    raise KeyError("the prompt row has no 'answer' field")
  return float(answer_of(completion) == str(row["answer"]).strip())


def format_check(prompt: str, completion: str, row: dict) -> float:
  del prompt
  first, _, rest = completion.partition("\n")
  return float(re.fullmatch(row.get("format", INTEGER), first.strip()) is not None
               and not rest.strip())
