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
  m.final_norm_params()                      # scale, eps, zero-centred, soft-cap: as data
  m.generate(["def f("]), m.logprobs([[1, 5]], [[9]]), m.chat([{"role": "user", "content": "Hi"}])
  e = m.encode([{"role": "user", "content": "Hi"}])   # ids, tokens, text, token types, chat spans
  m.logprobs(["def f("], top_k=5, max_new_tokens=8)   # greedy, then scored: top-5 per step
  m.capabilities, m.compiled_programs()                # capabilities.py; forward buckets lengths
  m.forward(ids, to="torch")                 # CPU torch tensors (torch imported only then)
  m = mi.wrap(params, cfg)                   # parameters already in memory (a training run's)

Sites: MaxText/layers/sites.py. CLI: `python -m MaxText.inspect --help`.
"""
from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Sequence

from MaxText.inspect.capabilities import Capabilities, capabilities_of
from MaxText.inspect.trace import Trace

if TYPE_CHECKING:
  from MaxText.inspect.encoding import Encoding, Span
  from MaxText.inspect.model import Inspector
  from MaxText.inspect.scoring import StepLogprobs

BASE_YML = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "configs", "base.yml")

__all__ = ["Capabilities", "Encoding", "Inspector", "Span", "StepLogprobs", "Trace",
           "capabilities", "capabilities_of", "load", "wrap"]

# the API's classes that need the model's machinery (jax), by the module that defines them,
# imported on first use: `python -m MaxText.inspect` imports this package first, and its --help
# needs none of them (capabilities.py and trace.py import no jax, and the function `capabilities`
# below must replace the submodule of that name on the package, so they stay above)
_LAZY = {"Encoding": "encoding", "Span": "encoding", "Inspector": "model",
         "StepLogprobs": "scoring"}


def __getattr__(name: str):
  if name not in _LAZY:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
  globals()[name] = value
  return value


def _source(hf_path, load_parameters_path) -> str:
  if (hf_path is None) == (load_parameters_path is None):
    raise ValueError("give one of hf_path=... or load_parameters_path=...")
  return f"hf_path={hf_path}" if hf_path else f"load_parameters_path={load_parameters_path}"


def load(*, hf_path: str | None = None, load_parameters_path: str | None = None,
         overrides: Sequence[str] = (), config: str = BASE_YML, devices=None,
         attention: str = "reference") -> Inspector:
  """A model ready to inspect: the parameters of a Hugging Face folder (`hf_path`, converted in
  memory) or of a checkpoint (`load_parameters_path`: a run's checkpoints/, a step, a converter's
  output), with `overrides` (key=value config keys: the mesh, the tokenizer, ...) on `config`.
  `attention`: capabilities.py."""
  from MaxText import inference
  from MaxText.inspect.model import Inspector
  capabilities_of_attention(attention)
  source = _source(hf_path, load_parameters_path)
  return Inspector(inference.load([config, source, *overrides], devices=devices), attention)


def wrap(params, cfg, *, devices=None, attention: str = "reference") -> Inspector:
  """An inspection model around parameters already in memory (host or device arrays of the
  model `cfg`, a Config, describes: a training run's), placed on the mesh of `cfg` — no
  checkpoint round trip."""
  from MaxText import inference
  from MaxText.inspect.model import Inspector
  capabilities_of_attention(attention)
  return Inspector(inference.load(cfg, devices=devices, params=params), attention)


def capabilities(*, hf_path: str | None = None, load_parameters_path: str | None = None,
                 overrides: Sequence[str] = (), config: str = BASE_YML,
                 attention: str = "reference") -> Capabilities:
  """A model's capabilities from its config, tokenizer and processor files alone (no parameters
  are read, nothing compiles)."""
  from MaxText import inference
  from MaxText.data.multimodal.processor import Processor
  from MaxText.data.tokenizers import HFTokenizer
  from MaxText.models.model_config import ModelConfig
  cfg = inference.resolve_config([config, _source(hf_path, load_parameters_path), *overrides])
  tokenizer, _ = inference.tokenizer_for(cfg)
  chat = isinstance(tokenizer, HFTokenizer)
  processor = Processor.for_tokenizer(tokenizer) if tokenizer is not None else None
  takes = [m for m in ("image", "audio") if processor is not None and not processor.takes(m)]
  return capabilities_of(ModelConfig.from_config(cfg), attention=attention, chat=chat,
                         processor_takes=takes)


def capabilities_of_attention(attention: str) -> None:
  from MaxText.inspect.capabilities import ATTENTION_SETTINGS
  if attention not in ATTENTION_SETTINGS:
    raise ValueError(f"attention={attention!r}: one of {ATTENTION_SETTINGS}")
