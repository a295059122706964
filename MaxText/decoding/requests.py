"""What a decoding request gives back and how its batches are sized: shared by the engine
(MaxText/decoding/engine.py) and its speculative programs (speculative.py)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import jax
import numpy as np

MIN_PROMPT_BUCKET = 16


@dataclass
class Completion:
  prompt_ids: list[int]
  output_ids: list[int] = field(default_factory=list)
  output_logprobs: list[float] = field(default_factory=list)
  finish_reason: str = "length"     # "eos" | "stop" | "length"


def bucket(n: int, minimum: int = 1, cap: int | None = None) -> int:
  """The next power of two >= max(n, minimum), at most `cap`."""
  size = 1 << max(0, math.ceil(math.log2(max(n, minimum, 1))))
  return size if cap is None else min(size, cap)


def fetch(x) -> np.ndarray:
  """A replicated result on the host (its local copy: works in a multi-process run too)."""
  return np.asarray(x.addressable_data(0)) if isinstance(x, jax.Array) else np.asarray(x)
