"""One rollout batch: G completions of each of the step's prompts from the decoding engine with the
current parameters (co-located: the training mesh and the parameters as they are sharded for
training), their rewards, and the [N, S] policy batch the GRPO step trains on (MaxText/rl/batch.py).

The sampler's key of completion j of step s is (seed, (s − 1)·N + j, tokens generated before)
(`decoding/sampling.py`): a function of the step, so a resumed run draws the same completions bit
for bit with nothing saved.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from MaxText.decoding.engine import Completion, Engine
from MaxText.decoding.sampling import Sampling
from MaxText.rl.prompts import PromptSet
from MaxText.rl.rewards import RewardScorer


@dataclass
class Rollout:
  arrays: dict[str, np.ndarray]      # the policy batch's tokens and masks [N, S] (rl/batch.py)
  rollout_logprobs: np.ndarray       # [N, S]: the engine's log-probabilities of the completions
  rewards_NF: np.ndarray             # per reward function, unweighted
  rewards: np.ndarray                # [N] weighted sum
  lengths: np.ndarray                # [N] completion tokens
  finished: np.ndarray               # [N] ended by eos or a stop string (not max_new_tokens)


def completion_text(c: Completion, eos_ids: Sequence[int], decode: Callable) -> str:
  ids = c.output_ids[:-1] if c.finish_reason == "eos" and c.output_ids[-1] in eos_ids \
      else c.output_ids
  return decode(ids)


def arrays_of(prompts: Sequence[Sequence[int]], completions: Sequence[Completion], seq: int
              ) -> tuple[dict[str, np.ndarray], np.ndarray]:
  """The policy batch (rl/batch.py: input_ids, token_mask, generation_mask; [N, S], right-padded)
  of prompt + completion rows, and the engine's log-probabilities aligned with the tokens (0
  outside the completions)."""
  N = len(prompts)
  out = {"input_ids": np.zeros((N, seq), np.int32), "token_mask": np.zeros((N, seq), np.int32),
         "generation_mask": np.zeros((N, seq), np.int32)}
  logprobs = np.zeros((N, seq), np.float32)
  for j, (p, c) in enumerate(zip(prompts, completions)):
    row = list(p) + list(c.output_ids)
    out["input_ids"][j, :len(row)] = row
    out["token_mask"][j, :len(row)] = 1
    out["generation_mask"][j, len(p):len(row)] = 1
    logprobs[j, len(p):len(row)] = c.output_logprobs
  return out, logprobs


def generate(engine: Engine, params, prompts: PromptSet, idx: Sequence[int], *, copies: int,
             sampling: Sampling, first_row: int, max_new_tokens: int, eos_ids: Sequence[int],
             stop: Sequence[str], decode: Callable) -> list[Completion]:
  """`copies` completions of each prompt in `idx`, rows in that order (a group: consecutive)."""
  ids = [prompts.ids[i] for i in idx for _ in range(copies)]
  return engine.generate(params, ids, max_new_tokens=max_new_tokens, sampling=sampling,
                         eos_ids=list(eos_ids), stop=list(stop), detokenize=decode,
                         row_ids=range(first_row, first_row + len(ids)))


def score(scorer: RewardScorer, prompts: PromptSet, idx: Sequence[int], copies: int,
          completions: Sequence[Completion], eos_ids: Sequence[int], decode: Callable
          ) -> np.ndarray:
  """[N, F] rewards of the completions (rows as `generate` gives them)."""
  rows = [i for i in idx for _ in range(copies)]
  return scorer.score([prompts.texts[i] for i in rows],
                      [completion_text(c, eos_ids, decode) for c in completions],
                      [prompts.rows[i] for i in rows], [prompts.where(i) for i in rows])


def rollout(engine: Engine, params, prompts: PromptSet, idx: Sequence[int], scorer: RewardScorer,
            *, copies: int, sampling: Sampling, first_row: int, max_new_tokens: int,
            eos_ids: Sequence[int], stop: Sequence[str], decode: Callable, seq: int) -> Rollout:
  completions = generate(engine, params, prompts, idx, copies=copies, sampling=sampling,
                         first_row=first_row, max_new_tokens=max_new_tokens, eos_ids=eos_ids,
                         stop=stop, decode=decode)
  rewards_NF = score(scorer, prompts, idx, copies, completions, eos_ids, decode)
  arrays, logprobs = arrays_of([prompts.ids[i] for i in idx for _ in range(copies)],
                               completions, seq)
  return Rollout(arrays, logprobs, rewards_NF, scorer.total(rewards_NF),
                 np.array([len(c.output_ids) for c in completions], np.float32),
                 np.array([c.finish_reason != "length" for c in completions], np.float32))


def replace_groups(ro: Rollout, groups: Sequence[int], new: Rollout, copies: int) -> Rollout:
  """`ro` with its groups `groups` (group k: rows k·copies … (k + 1)·copies − 1) replaced, in
  order, by the groups of `new` (DAPO's dynamic sampling: groups of equal rewards resampled)."""
  rows = np.array([g * copies + j for g in groups for j in range(copies)], np.int64)

  def put(old: np.ndarray, fresh: np.ndarray) -> np.ndarray:
    out = old.copy()
    out[rows] = fresh
    return out

  return Rollout({k: put(v, new.arrays[k]) for k, v in ro.arrays.items()},
                 put(ro.rollout_logprobs, new.rollout_logprobs), put(ro.rewards_NF, new.rewards_NF),
                 put(ro.rewards, new.rewards), put(ro.lengths, new.lengths),
                 put(ro.finished, new.finished))

