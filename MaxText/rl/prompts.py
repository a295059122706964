"""GRPO's prompts: a .jsonl file read and tokenized once, checked against the sequence budget, and
the prompts of each rollout batch chosen as a function of (seed, step) only — so a resumed run
takes the same prompts with nothing saved.

Each line is an object with exactly one of `prompt` (text; the tokenizer's bos first when
`add_bos`), `prompt_ids` or chat `messages` (the tokenizer's chat template), as `MaxText.decode`
reads a prompt file, plus any fields the reward functions read (e.g. `answer`). Epoch e visits the
prompts in the permutation seeded by (seed, e); step s takes positions (s-1)·P … s·P-1 of the
concatenated epochs (P = prompts_per_step).
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from typing import Callable

import numpy as np

from MaxText.config.load import ConfigError


@dataclass(frozen=True)
class PromptSet:
  path: str
  rows: list[dict]          # the jsonl objects
  ids: list[list[int]]      # their prompt tokens
  texts: list[str | None]   # the prompt as text (what the reward functions get; None: ids, no tokenizer)
  lines: list[int]          # 1-based line numbers in the file

  def where(self, i: int) -> str:
    return f"{self.path} line {self.lines[i]}"

  def for_step(self, step: int, per_step: int, seed: int) -> list[int]:
    """Indices of the prompts of rollout batch `step` (1-based)."""
    n = len(self.rows)
    return [int(epoch_order(n, seed, k // n)[k % n])
            for k in range((step - 1) * per_step, step * per_step)]


@functools.lru_cache(maxsize=4)
def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
  return np.random.default_rng([seed, epoch]).permutation(n)


def read_prompts(path: str, key: str, encode: Callable[[dict], list[int]],
                 decode: Callable[[list[int]], str | None], max_prompt_tokens: int,
                 budget_hint: str) -> PromptSet:
  """Reads and tokenizes `path` (config key `key`); ConfigError naming the line for a line that is
  no JSON object, an empty prompt, or one longer than `max_prompt_tokens` (`budget_hint` says
  where that number comes from)."""
  path = os.path.expanduser(path)
  if not path:
    raise ConfigError(f"{key}: GRPO needs a .jsonl file of prompts ({key}=FILE.jsonl)")
  if not os.path.isfile(path):
    raise ConfigError(f"{key}={path}: no such file")
  rows, ids, texts, lines = [], [], [], []
  with open(path, encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise ConfigError(f"{key}={path} line {n}: not JSON ({e})") from None
      if not isinstance(row, dict):
        raise ConfigError(f"{key}={path} line {n}: expected a JSON object, got "
                          f"{type(row).__name__}")
      try:
        tokens = encode(row)
      except ValueError as e:    # InferenceError: no prompt field, no tokenizer, bad ids
        raise ConfigError(f"{key}={path} line {n}: {e}") from None
      if not tokens:
        raise ConfigError(f"{key}={path} line {n}: the prompt is empty")
      if len(tokens) > max_prompt_tokens:
        raise ConfigError(f"{key}={path} line {n}: the prompt has {len(tokens)} tokens, more than "
                          f"the {max_prompt_tokens} allowed ({budget_hint})")
      rows.append(row)
      ids.append(tokens)
      texts.append(row["prompt"] if isinstance(row.get("prompt"), str) else decode(tokens))
      lines.append(n)
  if not rows:
    raise ConfigError(f"{key}={path}: no prompts in the file")
  return PromptSet(path, rows, ids, texts, lines)
