"""White-box inspection of any model of this trainer (no torch): hidden states, attention patterns
and logits as transformers gives them, named intervention and capture sites inside the compiled
forward (scanned layers included), gradients with respect to a site, the logit lens.

  from MaxText import inspect as mi          # (the package; stdlib `inspect` is untouched)
  m = mi.load(hf_path="path/to/hf_folder")   # or load_parameters_path=CKPT; key=value overrides
  t = m.forward([1, 5, 9], capture={"hidden_states", "attentions", "logits"}, layers=[3], heads=[0])
  t.hidden_states[0], t.attentions, t.logits                     # NumPy (trace.py)
  with m.intervene({"mlp_out.3": lambda x, ctx: 0 * x, "resid_post.5": steer}):
    t = m.forward(ids, capture={"logits", "resid_post.*"})
  value, g = m.grad("resid_post.2", lambda logits: logits[-1, 7], ids)
  m.unembed_weight(), m.final_norm(h), m.lens(h)                 # the logit lens
  m.generate(["def f("]), m.logprobs([[1, 5]], [[9]]), m.chat([{"role": "user", "content": "Hi"}])

Sites: MaxText/layers/sites.py. CLI: `python -m MaxText.inspect --help`.
"""
from __future__ import annotations

import os
from typing import Sequence

from MaxText.inspect.model import Inspector
from MaxText.inspect.trace import Trace

BASE_YML = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "configs", "base.yml")

__all__ = ["Inspector", "Trace", "load"]


def load(*, hf_path: str | None = None, load_parameters_path: str | None = None,
         overrides: Sequence[str] = (), config: str = BASE_YML, devices=None) -> Inspector:
  """A model ready to inspect: the parameters of a Hugging Face folder (`hf_path`, converted in
  memory) or of a checkpoint (`load_parameters_path`: a run's checkpoints/, a step, a converter's
  output), with `overrides` (key=value config keys: the mesh, the tokenizer, ...) on `config`."""
  from MaxText import inference
  if (hf_path is None) == (load_parameters_path is None):
    raise ValueError("give one of hf_path=... or load_parameters_path=...")
  source = f"hf_path={hf_path}" if hf_path else f"load_parameters_path={load_parameters_path}"
  return Inspector(inference.load([config, source, *overrides], devices=devices))
