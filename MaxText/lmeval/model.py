"""lm-eval's `maxtext` model: lm-evaluation-harness requests answered in this process by our
decoding engine (MaxText/inference.py), as lm-eval's own `hf` model answers them with transformers.

  lm_eval --model maxtext --model_args load_parameters_path=CKPT      (python -m MaxText.lmeval)

`--model_args` are config keys (`load_parameters_path` or `hf_path`, `dtype`, the mesh and
tokenizer keys, `decode_batch_size`, `max_cache_length`, `eos_ids`, `add_bos`; a key the model
does not read is refused, as by every tool) and this model's own: `config` (the config file,
default configs/base.yml), `max_length` (the longest input, default the model's
max_position_embeddings, or max_cache_length when set), `max_gen_toks` (default 256).
lm-eval's `--batch_size N` is `decode_batch_size` unless that key is given; `--device` is
lm-eval's torch device and means nothing here (JAX's devices and the mesh keys decide; from
Python, `MaxTextLM(devices=jax.devices()[:1], ...)` takes some of them).

The requests, as `hf` makes them (lm_eval/models/huggingface.py), so the two give the same
per-item results on the same weights:
- text → tokens: the tokenizer without special tokens, the bos in front when `add_bos` (our
  decoding's rule, MaxText/inference.py), not when the text already starts with the bos token
  (a chat template writes it); a context with its trailing spaces moved into the continuation,
  the continuation's tokens those of context + continuation after the context's
  (`TemplateLM._encode_pair`); an empty context is the bos (else the eos) token.
- loglikelihood: (sum of the continuation's log-probabilities, whether every continuation token
  is the most likely one there); an over-long input loses tokens on the left, as in `hf`.
- loglikelihood_rolling: lm-eval's disjoint rolling windows of `max_length`, each scored, summed.
- generate_until: per group of equal generation kwargs (`until`, `max_gen_toks`, `do_sample`,
  `temperature`, `top_p`, `top_k`, `min_p`; any other is refused, naming it), the context cut to
  `max_length - max_gen_toks` tokens on the left, generated until the model's eos ids, a stop
  string or `max_gen_toks`; the text decoded without special tokens and cut before the first
  stop string. Greedy unless `do_sample`.
- `--apply_chat_template`: the tokenizer's own chat template (MaxText/data/chat_template.py).
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterable, Sequence

from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import normalize_gen_kwargs, postprocess_generated_text
from tqdm import tqdm

from MaxText import inference
from MaxText.config.load import BASE_YML, ConfigError, load_config
from MaxText.data import chat_template
from MaxText.data.tokenizers import HFTokenizer, Tokenizer
from MaxText.decoding.engine import DecodeError
from MaxText.lmeval import NAME

DEFAULT_MAX_GEN_TOKS = 256           # lm-eval's `hf` default
SAMPLING_KWARGS = ("temperature", "top_p", "top_k", "min_p")
OWN_ARGS = ("config", "max_length", "max_gen_toks")
IGNORED_ARGS = ("device", "max_batch_size")   # lm-eval's torch device, its auto batch size cap
REQUESTS_PER_CALL = 8                # engine calls of this many batches each (a progress step)


def config_text(value: Any) -> str:
  """A `--model_args` value (lm-eval turned "true" into True, "8" into 8) as a config value."""
  if isinstance(value, bool):
    return str(value).lower()
  if isinstance(value, (list, dict)):
    return json.dumps(value)
  return str(value)


def config_argv(args: dict[str, Any], batch_size: Any) -> list[str]:
  """[config file, key=value, ...] of `--model_args` (`args`, without this model's own) and
  lm-eval's batch size."""
  keys = dict(args)
  config = str(keys.pop("config", BASE_YML))
  if batch_size is not None and "decode_batch_size" not in keys:
    text = str(batch_size)
    if not text.startswith("auto"):        # "auto" / "auto:N": the config's decode_batch_size
      keys["decode_batch_size"] = text
  return [config, *(f"{k}={config_text(v)}" for k, v in keys.items())]


@register_model(NAME)
class MaxTextLM(TemplateLM):
  """The `maxtext` model (module docstring)."""

  def __init__(self, batch_size: int | str | None = None, max_length: int | None = None,
               max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, devices: Sequence[Any] | None = None,
               **args: Any):
    super().__init__()
    if args.pop("trust_remote_code", False):
      raise ConfigError("trust_remote_code: the maxtext model runs no code from a model folder")
    for name in IGNORED_ARGS:
      args.pop(name, None)
    argv = config_argv(args, batch_size)
    load_config(argv, tool="lm_eval")       # a key the model does not read: refused (exit 2)
    self.model = inference.load(argv, devices, per_layer=True)
    if self.model.tokenizer is None:
      raise ConfigError(f"tokenizer_path: lm-eval sends text: {self.model.tokenizer_source}")
    self.tok: Tokenizer = self.model.tokenizer
    cfg = self.model.cfg
    limits = [n for n in (cfg.max_cache_length, cfg.max_position_embeddings) if n]
    self._max_length = int(max_length or min(limits))
    self._max_gen_toks = int(max_gen_toks)
    if not self.model.eos_ids and self.tok.eos_id is None:
      raise ConfigError("eos_ids: the tokenizer has no eos token; set eos_ids")
    folder = os.path.dirname(self.tok.path) if isinstance(self.tok, HFTokenizer) else None
    self._folder = folder
    self._bos_text = (chat_template.special_tokens(folder).get("bos_token")
                      if folder is not None else None)

  # ---- what lm-eval reads ------------------------------------------------------------------------
  @property
  def eot_token_id(self) -> int:
    return self.tok.eos_id if self.tok.eos_id is not None else self.model.eos_ids[0]

  @property
  def prefix_token_id(self) -> int:
    return self.tok.bos_id if self.tok.bos_id is not None else self.eot_token_id

  @property
  def max_length(self) -> int:
    return self._max_length

  @property
  def max_gen_toks(self) -> int:
    return self._max_gen_toks

  @property
  def tokenizer_name(self) -> str:
    return getattr(self.tok, "path", repr(self.tok)).replace("/", "__")

  def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                 **kwargs: Any) -> list[int]:
    ids = self.tok.encode(string)
    add = self.model.cfg.add_bos if add_special_tokens is None else add_special_tokens
    if add_special_tokens is None and self._bos_text and string.startswith(self._bos_text):
      add = False                     # the text writes its bos (a chat template's)
    return [self.tok.bos_id, *ids] if add and self.tok.bos_id is not None else ids

  def chat_template(self, chat_template: bool | str = False) -> str | None:
    if not chat_template or self._folder is None:
      return None
    return self._template()

  def _template(self) -> str:
    if self._folder is None:
      raise ConfigError(f"--apply_chat_template needs a Hugging Face tokenizer with a chat "
                        f"template; the tokenizer is {self.tok!r}")
    return chat_template.find_template(self._folder)

  def apply_chat_template(self, chat_history: list[dict[str, str]],
                          add_generation_prompt: bool = True) -> str:
    folder = self._folder
    template = self._template()
    assert folder is not None
    return chat_template.render(template, chat_history, chat_template.special_tokens(folder),
                                add_generation_prompt=add_generation_prompt)

  # ---- requests ----------------------------------------------------------------------------------
  def _calls(self, n: int) -> Iterable[slice]:
    """Slices of `n` requests, one engine call each (sorted longest first by the caller)."""
    step = self.model.cfg.decode_batch_size * REQUESTS_PER_CALL
    return (slice(i, i + step) for i in range(0, n, step))

  def _loglikelihood_tokens(self, requests: Sequence[tuple[Any, list[int], list[int]]],
                            disable_tqdm: bool = False, **kwargs: Any
                            ) -> list[tuple[float, bool]]:
    """(log p(continuation | context), whether greedy decoding writes the continuation) of
    (cache key, context tokens, continuation tokens) requests."""
    L = self.max_length
    prompts, conts = [], []
    for i, (_, context, cont) in enumerate(requests):
      if not cont or len(cont) > L:
        raise inference.InferenceError(f"request {i}: a continuation of {len(cont)} tokens "
                                       f"(1 to max_length={L})")
      whole = (context + cont)[-(L + 1):]              # as hf: the left is cut when too long
      prompts.append(whole[:len(whole) - len(cont)])
      conts.append(cont)
    order = sorted(range(len(requests)), key=lambda i: -(len(prompts[i]) + len(conts[i])))
    out: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
    bar = tqdm(total=len(requests), disable=disable_tqdm, desc="loglikelihood (maxtext)")
    for part in self._calls(len(order)):
      idx = order[part]
      try:
        scored = self.model.engine.score_top(self.model.params, [prompts[i] for i in idx],
                                             [conts[i] for i in idx], top=1)
      except DecodeError as e:
        raise inference.InferenceError(str(e)) from None
      for i, (logprobs, top_ids, _) in zip(idx, scored):
        answer = (float(logprobs.sum()), bool((top_ids[:, 0] == conts[i]).all()))
        out[i] = answer
        if requests[i][0] is not None:
          self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
      bar.update(len(idx))
    bar.close()
    return out

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    windows, owner = [], []
    for r, (string,) in enumerate(req.args for req in requests):
      for context, cont in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
          token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
          max_seq_len=self.max_length, context_len=1)):
        windows.append((None, context, cont))
        owner.append(r)
    totals = [0.0] * len(requests)
    for r, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm)):
      totals[r] += logprob
    for req, total in zip(requests, totals):
      self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
    return totals

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    groups: dict[str, list[int]] = {}
    for i, req in enumerate(requests):
      groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
    out = [""] * len(requests)
    bar = tqdm(total=len(requests), disable=disable_tqdm, desc="generate_until (maxtext)")
    for members in groups.values():
      gen_kwargs = requests[members[0]].args[1]
      until, options = self._generation(gen_kwargs)
      room = self.max_length - options["max_new_tokens"]
      if room < 1:
        raise inference.InferenceError(
            f"max_gen_toks={options['max_new_tokens']} leaves no room for a context in "
            f"max_length={self.max_length}")
      contexts = [self.tok_encode(requests[i].args[0])[-room:] for i in members]
      order = sorted(range(len(members)), key=lambda j: -len(contexts[j]))
      for part in self._calls(len(order)):
        idx = order[part]
        done = self.model.generate([contexts[j] for j in idx], stop=[s for s in until if s],
                                   **options)
        for j, g in zip(idx, done):
          text = postprocess_generated_text(g.text or "", until, None)
          i = members[j]
          out[i] = text
          self.cache_hook.add_partial("generate_until", requests[i].args, text)
        bar.update(len(idx))
    bar.close()
    return out

  def _generation(self, gen_kwargs: dict) -> tuple[list[str], dict[str, Any]]:
    """(stop strings, `InferenceModel.generate`'s keyword arguments) of lm-eval's generation
    kwargs (normalized as lm-eval normalizes them for every model)."""
    if not isinstance(gen_kwargs, dict):
      raise inference.InferenceError(f"generation kwargs must be a dict, got {gen_kwargs!r}")
    # (GenKwargs: a TypedDict with extra items of any type)
    kwargs: dict[str, Any] = dict(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks))
    until = kwargs.pop("until", None) or []
    until = [until] if isinstance(until, str) else list(until)
    options: dict[str, Any] = {"max_new_tokens": int(kwargs.pop("max_gen_toks")),
                               "temperature": 0.0}
    sample = bool(kwargs.pop("do_sample", False))
    for name in SAMPLING_KWARGS:
      value = kwargs.pop(name, None)
      if sample and value is not None:          # greedy: lm-eval set temperature to 0
        options[name] = type(getattr(self.model.cfg, name))(value)
    if kwargs:
      raise inference.InferenceError(
          f"generation kwargs {sorted(kwargs)}: the maxtext model takes until, max_gen_toks, "
          f"do_sample, {', '.join(SAMPLING_KWARGS)}")
    return until, options
