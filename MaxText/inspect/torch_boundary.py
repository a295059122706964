"""The optional torch boundary: a Trace's arrays as CPU torch tensors, for analyzers written in
torch. Imported only when asked for (`forward(..., to="torch")`); nothing else here imports torch.

bfloat16 arrays (NumPy's ml_dtypes bfloat16, which torch cannot read) cross as their 16-bit
patterns reinterpreted as torch.bfloat16, so every value is the same bits; other dtypes go through
`torch.from_numpy` (a copy of the same bits).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from MaxText.inspect.trace import Trace


def tensor(x):
  """One NumPy array → a CPU torch tensor with the same bits."""
  import torch  # pylint: disable=import-outside-toplevel
  x = np.array(x, copy=True, order="C")          # torch's own, writable memory
  if x.dtype.name == "bfloat16":
    return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
  return torch.from_numpy(x)


def to_torch(trace: Trace) -> Trace:
  """A copy of `trace` whose arrays are torch tensors (lists keep their None entries)."""
  conv = lambda a: None if a is None else tensor(a)
  return dataclasses.replace(
      trace, tokens=conv(trace.tokens),
      hidden_states=None if trace.hidden_states is None else [conv(h) for h in trace.hidden_states],
      attentions=None if trace.attentions is None else [conv(a) for a in trace.attentions],
      logits=conv(trace.logits), sites={k: conv(v) for k, v in trace.sites.items()},
      lengths=conv(trace.lengths), mm_token_type_ids=conv(trace.mm_token_type_ids))
