"""Log-probabilities as analyzers read them: per completion step the chosen token's log-probability
and the `top_k` most likely alternatives with theirs (`StepLogprobs`), for given completions or
for the model's own greedy completion (generated, then scored teacher-forced in the same call, so
the values are a forward pass's log-softmax, not the decoder's incremental ones).

Sampling seeds: `fresh_seed()` draws one from the OS (an unseeded `generate` differs from the last
one); an explicit seed reproduces, whatever batch the prompt lands in (MaxText/decoding/sampling.py).
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from MaxText.decoding.engine import DecodeError
from MaxText.inference import InferenceError, InferenceModel


@dataclass
class StepLogprobs:
  """One completion: `ids` [C], `logprobs` [C] (log p(ids[i] | prompt, ids[:i])), `top_ids`
  [C, k] and `top_logprobs` [C, k] (the k most likely tokens at each step, most likely first),
  `tokens` each id's text (None without a tokenizer)."""
  ids: np.ndarray
  logprobs: np.ndarray
  top_ids: np.ndarray
  top_logprobs: np.ndarray
  tokens: list[str] | None = None

  @property
  def greedy(self) -> np.ndarray:
    """[C] whether each token is the most likely one at its step."""
    return self.ids == self.top_ids[:, 0] if self.top_ids.shape[1] else np.zeros(0, bool)


def fresh_seed() -> int:
  return secrets.randbelow(2 ** 31)


def step_logprobs(inference: InferenceModel, prompt_ids: Sequence[Sequence[int]],
                  completions: Sequence[Sequence[int]], top_k: int, media=None
                  ) -> list[StepLogprobs]:
  """Teacher-forced log-probabilities of `completions` after `prompt_ids` with the top `top_k`
  alternatives per step (the engine's batched, bucketed scoring)."""
  try:
    scored = inference.engine.score_top(inference.params, prompt_ids, completions, max(top_k, 1),
                                        media=media)
  except DecodeError as e:
    raise InferenceError(str(e)) from None
  tok = inference.tokenizer
  out = []
  for c, (lp, ids, top) in zip(completions, scored):
    c = np.asarray(c, np.int32)
    out.append(StepLogprobs(c, lp, ids[:, :top_k], top[:, :top_k],
                            None if tok is None else [tok.decode([int(t)]) for t in c]))
  return out
