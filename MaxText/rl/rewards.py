"""The user's reward functions: loaded from `reward=package.module:function[,...]` and called on
each completion, with failures counted rather than fatal (up to `max_bad_rewards`).

A reward function is called as `f(prompt, completion, row) -> number`: `prompt` the prompt's text
(the jsonl row's `prompt`, or the decoded prompt tokens; None for `prompt_ids` without a
tokenizer), `completion` the completion's text, `row`
the prompt's jsonl object as read. bool, int and float are numbers; anything else, NaN/inf, or an
exception is a bad reward: it is logged with the prompt's line and the function's name, counted,
and scored 0; one more than `max_bad_rewards` stops the run with exit 3 (DataError). The count
starts at 0 in each invocation (a resumed run counts again). With several processes the functions
run on process 0 only and its results are broadcast.
Examples for verifiable tasks: MaxText/rl/example_rewards.py.
"""
from __future__ import annotations

import importlib
import math
import numbers
from dataclasses import dataclass
from typing import Callable, Sequence

import jax
import numpy as np

from MaxText.config.load import ConfigError
from MaxText.data.errors import DataError

# (prompt text or None, completion text, row) -> a number; what it returns is checked (a bad reward)
RewardFn = Callable[[str | None, str, dict], object]


@dataclass(frozen=True)
class Reward:
  name: str          # "package.module:function", as given
  fn: RewardFn
  weight: float


def load_rewards(spec: str, weights: Sequence[float]) -> list[Reward]:
  """The functions `spec` names ("module:function", comma-separated). ConfigError naming the
  function when one cannot be imported or is not callable, or when the weights do not match."""
  names = [s.strip() for s in spec.split(",") if s.strip()]
  if not names:
    raise ConfigError("reward: GRPO needs at least one reward function, e.g. "
                      "reward=MaxText.rl.example_rewards:exact_answer")
  if weights and len(weights) != len(names):
    raise ConfigError(f"reward_weights={list(weights)}: {len(weights)} weights for "
                      f"{len(names)} reward functions ({', '.join(names)})")
  out = []
  for i, name in enumerate(names):
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
      raise ConfigError(f"reward={name!r}: expected package.module:function")
    try:
      module = importlib.import_module(module_name)
    except Exception as e:  # pylint: disable=broad-except  (whatever the user's import raises)
      raise ConfigError(f"reward={name!r}: module {module_name!r} does not import: "
                        f"{type(e).__name__}: {e}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
      raise ConfigError(f"reward={name!r}: module {module_name!r} has no function {attr!r}")
    out.append(Reward(name, fn, float(weights[i]) if weights else 1.0))
  return out


class RewardScorer:
  """Scores completions with every reward function; counts the bad calls of the run."""

  def __init__(self, rewards: Sequence[Reward], max_bad: int, log: Callable[[str], None]):
    self.rewards, self.max_bad, self.log = list(rewards), max_bad, log
    self.bad = 0

  def _one(self, reward: Reward, prompt: str | None, completion: str, row: dict,
           where: str) -> float:
    number = 0.0
    try:
      value = reward.fn(prompt, completion, row)
      problem = None
      if not isinstance(value, numbers.Real):
        problem = f"returned {type(value).__name__} {value!r:.80}, not a number"
      else:
        number = float(value)
        if not math.isfinite(number):
          problem = f"returned {value}"
    except Exception as e:  # pylint: disable=broad-except  (the user's code)
      problem = f"raised {type(e).__name__}: {e}"
    if problem is None:
      return number
    self.bad += 1
    self.log(f"bad reward ({self.bad}/{self.max_bad} allowed, max_bad_rewards): {reward.name} "
             f"{problem} on {where}; completion {completion!r:.120}; scored 0")
    if self.bad > self.max_bad:
      raise DataError(f"{self.bad} bad rewards, more than max_bad_rewards={self.max_bad}; the "
                      f"last: {reward.name} {problem} on {where}")
    return 0.0

  def _score_here(self, prompts, completions, rows, wheres) -> np.ndarray:
    return np.array([[self._one(r, p, c, row, w) for r in self.rewards]
                     for p, c, row, w in zip(prompts, completions, rows, wheres)],
                    np.float32).reshape(len(completions), len(self.rewards))

  def score(self, prompts: Sequence[str | None], completions: Sequence[str], rows: Sequence[dict],
            wheres: Sequence[str]) -> np.ndarray:
    """[N, F] rewards of N completions under F functions (unweighted). With several processes the
    functions run on process 0 only (once per completion, whatever their side effects or
    randomness) and every process gets its rewards, its count of bad ones and its verdict."""
    if jax.process_count() == 1:
      return self._score_here(prompts, completions, rows, wheres)
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    rewards = np.zeros((len(completions), len(self.rewards)), np.float32)
    error = ""
    if jax.process_index() == 0:
      try:
        rewards = self._score_here(prompts, completions, rows, wheres)
      except DataError as e:
        error = str(e)
    rewards, bad, failed = multihost_utils.broadcast_one_to_all(
        (rewards, np.int32(self.bad), np.int32(bool(error))))
    self.bad = int(bad)
    if int(failed):
      raise DataError(error or f"more than max_bad_rewards={self.max_bad} bad rewards (see the "
                      "log of process 0)")
    return np.asarray(rewards)

  def total(self, per_fn_NF: np.ndarray) -> np.ndarray:
    return per_fn_NF @ np.array([r.weight for r in self.rewards], np.float32)
