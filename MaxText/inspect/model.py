"""An inspectable model: forward passes that capture and edit named sites (MaxText/layers/sites.py)
inside the compiled program, gradients with respect to a site, and the decoding API of
MaxText/inference.py (generate, logprobs, chat) on the same parameters.

The forward runs the family's model with the dot-product attention op (the only one that
materialises the probabilities; the parameters are the same whatever op trained them), under the
mesh and logical-axis rules the model was loaded with. One program is compiled per set of
interventions (name and function object), captures, heads and input shape, and reused after.

Images and audio (a model whose family takes them): `forward`, `generate`, `logprobs` and `chat`
take `images=` / `audio=` and the processor's tensors by transformers' names as
`MaxText.inference` does; the Trace then carries `mm_token_type_ids` and each image's patch grid.

Bounded compiles: `forward` pads the batch to a power of two of rows and the length to a power of
two of tokens (>= MIN_LENGTH_BUCKET), the padding in segment 0 (which real tokens never attend:
causal, same segment only) and cut off the results, so prompts of many lengths share a handful of
programs (`compiled_programs()` counts them); `logprobs` uses the engine's buckets. With
interventions the exact shape runs unless `buckets=True` (a function may be written for it).

Threads: one lock serialises every call on the model (the engine's programs and the host state
they share); interventions set by `intervene` are per thread.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from MaxText.data.errors import DataError
from MaxText.data.multimodal import prompts as media_prompts
from MaxText.data.tokenizers import HFTokenizer, token_label
from MaxText.decoding.engine import DecodeError, batch_media, bucket
from MaxText.inference import InferenceError, InferenceModel, Prepared
from MaxText.inspect.capabilities import Capabilities, attention_op, capabilities_of
from MaxText.inspect import encoding as enc_lib
from MaxText.inspect import scoring
from MaxText.inspect.trace import Trace
from MaxText.layers import sites
from MaxText.layers.norms import RMSNorm
from MaxText.models.registry import make_model_def
from MaxText.sharding.rules import use_rules

HIGH_LEVEL = ("hidden_states", "attentions", "logits")
MIN_LENGTH_BUCKET = 16


def locked(fn: Callable) -> Callable:
  """`fn` under the model's lock (module docstring: threads)."""
  @functools.wraps(fn)
  def call(self, *args, **kwargs):
    with self._lock:
      return fn(self, *args, **kwargs)
  return call


class Inspector:
  """`forward`, `intervene`, `grad`, `unembed_weight`, `final_norm`, and `generate`, `logprobs`,
  `chat` (MaxText/inference.py) of one loaded model."""

  def __init__(self, inference: InferenceModel, attention: str = "reference"):
    """`attention`: "reference" (the dot-product op, which gives attention probabilities) or
    "model" (the op the model is configured with; no attention captures)."""
    self.inference = inference
    engine = inference.engine
    op = attention_op(engine.mcfg, attention)
    self.attention = attention
    self.mcfg = dataclasses.replace(engine.mcfg, attention=op, remat_policy="none")
    self.num_layers = self.mcfg.num_decoder_layers
    self.model_def = make_model_def(self.mcfg)
    self.mesh, self.rules, self.params = engine.mesh, engine.rules, inference.params
    self._local = threading.local()             # this thread's interventions
    self._lock = threading.RLock()
    self._programs: dict[Any, Callable] = {}
    self._reached: dict[Any, set[str]] = {}     # per program: the site names its forward passes
    self._traces = 0                            # forward programs traced (so compiled)
    self._jitted = self._lens_pieces()
    self.last_seed: int | None = None           # the seed of the last `generate`
    self._contrastive = None                    # decoding/contrastive.py, built on first use

  @property
  def _interventions(self) -> dict[str, Callable]:
    return getattr(self._local, "interventions", {})

  @_interventions.setter
  def _interventions(self, value: dict[str, Callable]) -> None:
    self._local.interventions = value

  @functools.cached_property
  def capabilities(self) -> Capabilities:
    """What this model can do (MaxText/inspect/capabilities.py), without compiling."""
    tok = self.inference.tokenizer
    chat = isinstance(tok, HFTokenizer)
    try:
      processor = self.inference.processor
    except ValueError:
      processor = None
    takes = [m for m in ("image", "audio") if processor is not None and not processor.takes(m)]
    return capabilities_of(self.mcfg if self.attention == "reference" else
                                self.inference.engine.mcfg, attention=self.attention, chat=chat,
                                processor_takes=takes)

  def compiled_programs(self) -> int:
    """Programs compiled so far for this model: its forward passes and the engine's decoding and
    scoring programs."""
    return self._traces + self.inference.engine.compiled_programs()

  # ---- decoding (MaxText/inference.py) ------------------------------------------------------------
  @locked
  def generate(self, prompts, *, seed: int | None = None, **kwargs):
    """`InferenceModel.generate`: completions of text, token-id or chat prompts. `seed=None`
    draws a fresh seed (kept in `last_seed`); an explicit seed reproduces."""
    self.last_seed = scoring.fresh_seed() if seed is None else int(seed)
    return self.inference.generate(prompts, seed=self.last_seed, **kwargs)

  @locked
  def logprobs(self, prompts: Sequence, completions: Sequence | None = None, *, top_k: int = 0,
               max_new_tokens: int | None = None, images=None, audio=None, **tensors):
    """log p of each completion token given the prompt (text or token ids, with its images and
    clips) and the tokens before: a float array per completion. With `top_k`, or without
    `completions` (then the model's greedy completion of `max_new_tokens`, generated and scored
    in this call), a `StepLogprobs` per prompt: the ids, their log-probabilities and the `top_k`
    most likely tokens at each step with theirs."""
    prepared = self.inference.prepare(prompts, images=images, audio=audio, **tensors)
    if completions is None:
      done = self.inference.generate(prompts, max_new_tokens=max_new_tokens, temperature=0.0,
                                     images=images, audio=audio, **tensors)
      ids = [g.output_ids for g in done]
    else:
      if len(completions) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
      ids = [self._text_ids(c) if isinstance(c, str) else self.inference.encode(c)
             for c in completions]
    if completions is not None and not top_k:
      return self.inference.score(prepared.ids, ids, media=prepared.media)
    if top_k < 0:
      raise ValueError(f"top_k={top_k} must be >= 0")
    return scoring.step_logprobs(self.inference, prepared.ids, ids, top_k, prepared.media)

  @locked
  def contrastive_generate(self, prompts: Sequence, contrasts: Sequence, *, alpha: float = 1.0,
                           max_new_tokens: int | None = None, temperature: float = 0.0,
                           seed: int | None = None, eos_ids: Sequence[int] | None = None,
                           images=None, audio=None, contrast_images=None, contrast_audio=None):
    """Contrastive decoding (MaxText/decoding/contrastive.py): each prompt beside its contrast
    (instruction-contrastive: the prompt with a perturbed instruction; visual-contrastive: the
    same prompt with `contrast_images`, a distorted image), the next token from (1 + alpha) *
    logits(prompt) - alpha * logits(contrast); `Generation`s as `generate` gives them."""
    from MaxText.decoding.contrastive import ContrastiveDecoder
    from MaxText.decoding.sampling import Sampling
    from MaxText.inference import Generation
    inf = self.inference
    contrastive = getattr(self, "_contrastive", None)
    if contrastive is None:
      contrastive = self._contrastive = ContrastiveDecoder(inf.engine)
    pos = inf.prepare(prompts, images=images, audio=audio)
    neg = inf.prepare(contrasts, images=contrast_images, audio=contrast_audio)
    self.last_seed = scoring.fresh_seed() if seed is None else int(seed)
    sampling = Sampling(temperature=temperature, seed=self.last_seed)
    try:
      done = contrastive.generate(
          self.params, pos.ids, neg.ids, alpha=alpha, sampling=sampling,
          max_new_tokens=inf.cfg.max_new_tokens if max_new_tokens is None else max_new_tokens,
          eos_ids=inf.eos_ids if eos_ids is None else list(eos_ids), media=pos.media,
          contrast_media=neg.media)
    except DecodeError as e:
      raise InferenceError(str(e)) from None
    return [Generation(c.prompt_ids, c.output_ids, c.output_logprobs, c.finish_reason,
                       inf.text(c.output_ids)) for c in done]

  def save_peft(self, folder: str) -> list[str]:
    """This model's LoRA adapters (MaxText/repair/: `lora_finetune`) as a PEFT folder
    (adapter_config.json, adapter_model.safetensors) for transformers + peft; returns the adapted
    modules' names."""
    from MaxText.checkpoint_conversion.peft_adapters import export_peft
    from MaxText.models.registry import get_hf_map
    cfg = self.inference.cfg
    if not cfg.lora_rank:
      raise ValueError("save_peft: this model has no adapters (repair.lora_finetune makes one)")
    if not cfg.hf_model_type:
      raise ValueError("save_peft: the model has no hf_model_type (a Hugging Face architecture "
                       "to name its modules by)")
    with self._lock:
      host: Any = jax.device_get(self.params)
    base = dataclasses.replace(self.inference.engine.mcfg, lora_rank=0)
    return export_peft(folder, host, get_hf_map(cfg.hf_model_type), base, rank=cfg.lora_rank,
                       alpha=cfg.lora_alpha, base_model=cfg.hf_path or cfg.load_parameters_path)

  def _text_ids(self, text: str) -> list[int]:
    """A completion's text as ids (no bos: it continues the prompt)."""
    if self.inference.tokenizer is None:
      raise ValueError(f"a text completion needs a tokenizer: {self.inference.tokenizer_source}")
    return self.inference.tokenizer.encode(text)

  def chat(self, messages: Sequence[dict], *, tools: Sequence[dict] | None = None,
           chat_template_kwargs: dict | None = None, **kwargs):
    """One chat completion: `messages` rendered with the tokenizer's chat template (their image /
    audio parts, or `images=` / `audio=` for parts without a source; `tools` and
    `chat_template_kwargs` as transformers' `apply_chat_template` takes them)."""
    prompt = {"messages": list(messages), "tools": tools,
              "chat_template_kwargs": chat_template_kwargs}
    return self.generate([prompt], **kwargs)[0]

  def tokenize(self, prompt) -> list[int]:
    return self.inference.encode(prompt)

  # ---- encodings (encoding.py) ----------------------------------------------------------------------
  @locked
  def encode(self, prompt, *, images=None, audio=None, chat: bool | None = None,
             tools: Sequence[dict] | None = None, chat_template_kwargs: dict | None = None,
             **tensors) -> enc_lib.Encoding:
    """`prompt` (text, token ids, chat messages — a list of {"role", "content"} or a prompt
    object) as the model reads it, with its text, offsets, token types and chat turns."""
    return self._encode(prompt, images, audio, chat, tools, chat_template_kwargs, tensors)[0]

  def _encode(self, prompt, images, audio, chat, tools, template_kwargs, tensors
              ) -> tuple[enc_lib.Encoding, Prepared]:
    return enc_lib.encode(self.inference, prompt, images=images, audio=audio, chat=chat,
                          tools=tools, template_kwargs=template_kwargs, tensors=tensors)

  def token_text(self, ids: Iterable[int]) -> list[str]:
    """Each id's own text (for labels): special tokens by their name (`<bos>`), `<id>` without a
    tokenizer or for an id with no text (tokenizers.token_label)."""
    return [token_label(self.inference.tokenizer, i) for i in ids]

  # ---- lens pieces ---------------------------------------------------------------------------------
  def _model(self, params=None):
    return nnx.merge(self.model_def.graphdef, self.params if params is None else params)

  @locked
  def unembed_weight(self) -> np.ndarray:
    """The head's matrix [V, D] (logits = final_norm(h) @ W.T, then the family's soft-cap)."""
    return np.asarray(self._jitted["unembed"](self.params))

  def final_norm_params(self) -> dict[str, Any]:
    """The final norm and the head's soft-cap as data, so a lens can be rebuilt outside:
    final_norm(h) = h / sqrt(mean(h^2) + eps) * (1 + scale if zero_centered else scale), the
    cast to the compute dtype before the scale when `cast_before_scale`; logits = softcap *
    tanh(final_norm(h) @ W.T / softcap) when softcap > 0. `scale` is None for a norm without
    one."""
    norm = self._model().final_norm
    if not isinstance(norm, RMSNorm):
      raise ValueError(f"the model's final norm is a {type(norm).__name__}, not an RMSNorm: its "
                       f"parameters have no common description")
    return {"scale": None if norm.scale is None else np.asarray(norm.scale[...], np.float32),
            "eps": float(norm.eps), "zero_centered": bool(norm.zero_centered),
            "cast_before_scale": bool(norm.cast_before_scale),
            "dtype": str(jnp.dtype(norm.dtype)),
            # the schema's head soft-cap key (0 or absent: none)
            "softcap": float(getattr(self.mcfg, "final_logit_softcap", 0.0) or 0.0)}

  @locked
  def final_norm(self, x) -> np.ndarray:
    """The model's final norm applied to hidden states [..., D]."""
    return np.asarray(self._jitted["final_norm"](self.params, jnp.asarray(x)))

  @locked
  def lens(self, x, normed: bool = False) -> np.ndarray:
    """The logit lens: the model's head (soft-cap included) on final_norm(x) (on x itself when
    `normed`: the last hidden state is already after the final norm), fp32 [..., V]."""
    return np.asarray(self._jitted["lens"](self.params, jnp.asarray(x), normed=normed))

  def _lens_pieces(self) -> dict[str, Callable]:
    def rows(x):
      return x.reshape(1, -1, x.shape[-1]).astype(self.mcfg.compute_dtype)

    def lens(p, x, normed):
      model = self._model(p)
      x_BSD = rows(x) if normed else model.final_norm(rows(x))
      with jax.default_matmul_precision(self.model_def.matmul_precision):
        return model.logits(x_BSD).reshape(*x.shape[:-1], -1)

    return {"unembed": jax.jit(lambda p: self._model(p).unembedding()),
            "final_norm": jax.jit(lambda p, x: self._model(p).final_norm(rows(x)).reshape(x.shape)),
            "lens": jax.jit(lens, static_argnames="normed")}

  # ---- interventions -------------------------------------------------------------------------------
  @contextlib.contextmanager
  def intervene(self, interventions: dict[str, Callable]):
    """Inside, every `forward` / `grad` applies `interventions` ({site name or glob: fn(x,
    context) -> x'}, JAX functions) inside the compiled forward."""
    for name in interventions:
      sites.expand(name, self.num_layers)          # a bad name fails here, naming it
    outer = self._interventions
    self._interventions = {**outer, **interventions}
    try:
      yield self
    finally:
      self._interventions = outer

  # ---- the forward ---------------------------------------------------------------------------------
  def _prepared(self, token_ids, images, audio, tensors) -> tuple[Any, Prepared | None]:
    """(the token ids to run, the call's prompts as the model takes them when it has images or
    audio, else None)."""
    single = isinstance(token_ids, (str, dict)) or (
        len(token_ids) > 0 and isinstance(token_ids[0], (int, np.integer)))
    prompts = [token_ids] if single else list(token_ids)
    has_parts = any(isinstance(p, dict) and any(p.get(k) for k in ("images", "audio"))
                    for p in prompts)
    if images is None and audio is None and not tensors and not has_parts and not any(
        isinstance(p, dict) and "messages" in p for p in prompts):
      return token_ids, None
    prepared = self.inference.prepare(prompts, images=images, audio=audio, **tensors)
    if prepared.media is None:
      return (prepared.ids[0] if single else prepared.ids), None
    self.inference.check_room(prepared, 0, self.mcfg.max_position_embeddings,
                              "the model's max_position_embeddings")
    return (prepared.ids[0] if single else prepared.ids), prepared

  def _inputs(self, token_ids: Any) -> tuple[bool, np.ndarray, np.ndarray]:
    """(batched?, tokens [B, S] right-padded with 0, lengths [B])."""
    if isinstance(token_ids, str) or (isinstance(token_ids, dict)):
      token_ids = self.tokenize(token_ids)
    arr = np.asarray(token_ids, dtype=object) if not isinstance(token_ids, np.ndarray) else token_ids
    batched = arr.ndim == 2 or (arr.ndim == 1 and len(arr) > 0 and not np.isscalar(arr[0])
                                and not isinstance(arr[0], (int, np.integer)))
    rows = [list(map(int, r)) for r in token_ids] if batched else [list(map(int, token_ids))]
    if not rows or any(len(r) == 0 for r in rows):
      raise ValueError("forward needs at least one token per row")
    bad = [t for r in rows for t in r if not 0 <= t < self.mcfg.vocab_size]
    if bad:
      raise ValueError(f"token ids outside the vocabulary [0, {self.mcfg.vocab_size}): {bad[:5]}")
    lengths = np.asarray([len(r) for r in rows], np.int32)
    tokens = np.zeros((len(rows), lengths.max()), np.int32)
    for i, r in enumerate(rows):
      tokens[i, :len(r)] = r
    return batched, tokens, lengths

  def _site_names(self, capture: Iterable[str], layers: Sequence[int] | None) -> tuple[tuple, tuple]:
    """(site patterns to capture, the exact names the user asked for, which must be reached)."""
    L = self.num_layers
    chosen = range(L) if layers is None else sorted(set(int(l) for l in layers))
    bad = [l for l in chosen if not 0 <= l < L]
    if bad:
      raise ValueError(f"layers {bad} are outside the model's {L} layers")
    names, exact = [], []
    for c in capture:
      if c == "hidden_states":
        names += ["resid_pre.0", *(f"resid_post.{l}" for l in chosen if l < L - 1)]
        names += ["final_norm_out"] if L - 1 in chosen else []
      elif c == "attentions":
        names += [f"attn_pattern.{l}" for l in chosen]
      elif c == "logits":
        names.append("logits")
      else:
        hits = sites.expand(c, L)
        names += hits
        exact += [c] if len(hits) == 1 and hits[0] == c else []
    return tuple(dict.fromkeys(names)), tuple(exact)

  def _program(self, capture: tuple, heads, interventions: dict, grad_site: str | None = None,
               objective: Callable | None = None):
    key = (capture, heads, tuple(interventions.items()), grad_site, objective)
    if key in self._programs:
      return self._programs[key], key
    L, graphdef = self.num_layers, self.model_def.graphdef

    def run(params, tokens_BS, positions_BS, segment_ids_BS, media, extra: dict):
      self._traces += 1
      probe = sites.Probe(L, {**interventions, **extra}, capture, heads)
      with sites.probing(probe), use_rules(self.mesh, self.rules), \
          jax.default_matmul_precision(self.model_def.matmul_precision):
        model = nnx.merge(graphdef, params)
        x_BSD, _ = model.forward_with_aux(tokens_BS, positions_BS, segment_ids_BS,
                                          return_hidden=True,
                                          **({"media": media} if media else {}))
        x_BSD = sites.site("final_norm_out", x_BSD)
        logits_BSV = sites.site("logits", model.logits(x_BSD))
      missing = [n for n in interventions if n not in probe.reached and
                 len(sites.expand(n, L)) == 1]
      if missing:
        raise ValueError(f"intervention sites {missing} are not in this model's forward (e.g. "
                         f"attention sites of a layer without softmax attention)")
      self._reached[key] = probe.reached
      return logits_BSV, probe.results

    if grad_site is None:
      def forward(params, tokens_BS, positions_BS, segment_ids_BS, media):
        return run(params, tokens_BS, positions_BS, segment_ids_BS, media, {})[1]
      fn = jax.jit(forward)
    else:
      assert objective is not None, "a gradient site needs an objective"
      def value(delta, params, tokens_BS, positions_BS, segment_ids_BS, media, unbatched):
        extra = {grad_site: lambda x, ctx: x + delta.astype(x.dtype)}
        logits_BSV = run(params, tokens_BS, positions_BS, segment_ids_BS, media, extra)[0]
        return objective(logits_BSV[0] if unbatched else logits_BSV)
      fn = jax.jit(self.model_def.at_precision(jax.value_and_grad(value)),
                   static_argnames=("unbatched",))
    self._programs[key] = fn
    return fn, key

  def _heads(self, heads: Sequence[int] | None) -> tuple[int, ...] | None:
    if heads is None:
      return None
    heads_ = tuple(int(h) for h in heads)
    bad = [h for h in heads_ if not 0 <= h < self.mcfg.num_query_heads]
    if bad:
      raise ValueError(f"heads {bad} are outside the model's {self.mcfg.num_query_heads} heads")
    return heads_

  def _placed(self, tokens: np.ndarray, lengths: np.ndarray, prepared: Prepared | None = None,
              padded: bool = False):
    """(tokens, positions, segment ids: 1 on each row's tokens, 0 on its padding, the rows'
    image / audio tensors) on the mesh; `padded`: rows and length padded to their buckets."""
    if padded:
      B, S = tokens.shape
      grown = np.zeros((bucket(B), bucket(S, MIN_LENGTH_BUCKET)), np.int32)
      grown[:B, :S] = tokens
      tokens, lengths = grown, np.concatenate([lengths, np.zeros(grown.shape[0] - B, np.int32)])
    B, S = tokens.shape
    positions = np.broadcast_to(np.arange(S, dtype=np.int32), (B, S))
    segments = (np.arange(S)[None, :] < lengths[:, None]).astype(np.int32)
    media = batch_media(prepared.media, range(len(prepared.media))) \
        if prepared is not None and prepared.media is not None else {}
    whole = NamedSharding(self.mesh, PartitionSpec())
    return jax.device_put((tokens, np.ascontiguousarray(positions), segments, media), whole)

  @locked
  def forward(self, token_ids=None, capture: Iterable[str] = HIGH_LEVEL,
              layers: Sequence[int] | None = None, heads: Sequence[int] | None = None,
              interventions: dict[str, Callable] | None = None, *, images=None, audio=None,
              to: str = "numpy", buckets: bool | None = None, **tensors) -> Trace:
    """A `Trace` of `token_ids` (one sequence: ids, a prompt, an `Encoding` of a text prompt; or
    a batch: a list of id lists, right-padded). `capture`: "hidden_states", "attentions", "logits"
    and/or site names or globs ("resid_post.*"); `layers`: the decoder layers whose hidden states
    and attentions are kept (None: all); `heads`: the heads kept at attention sites (None: all).
    Only what is asked for leaves the compiled program, and only those layers are kept inside it.
    `images`, `audio`, the processor's tensors: module docstring (a batch is then a list of
    prompts). A single prompt's Trace carries its `Encoding`. `to="torch"`: the Trace's arrays as
    CPU torch tensors (torch_boundary.py). `buckets`: pad to the length and batch buckets
    (module docstring); None: unless interventions are active (a function may be written for
    the prompt's shape, so it sees that shape); False: the exact shape, a program per shape.
    Every tensor of transformers' processor is taken (`forward(**processor(...))`): without
    `token_ids`, the prompts are `input_ids`' rows less their padding (one row: a single
    prompt); `input_ids`, `attention_mask` and `mm_token_type_ids` are checked against the
    prompts (MaxText.inference's `prepare`)."""
    if token_ids is None:
      if "input_ids" not in tensors:
        raise ValueError("forward needs token_ids (or the processor's input_ids)")
      try:
        rows = media_prompts.prompt_rows(tensors)
      except DataError as e:
        raise InferenceError(str(e)) from None
      token_ids = rows[0] if len(rows) == 1 else rows
    if to not in ("numpy", "torch"):
      raise ValueError(f"to={to!r}: 'numpy' or 'torch'")
    capture = _names(capture)
    self.capabilities.check_capture(capture, self.num_layers)
    encoding, token_ids, prepared = self._forward_inputs(token_ids, images, audio, tensors)
    batched, tokens, lengths = self._inputs(token_ids)
    names, exact = self._site_names(capture, layers)
    heads_ = self._heads(heads)
    edits = {**self._interventions, **(interventions or {})}
    program, key = self._program(names, heads_, edits)
    placed = self._placed(tokens, lengths, prepared,
                          padded=not edits if buckets is None else buckets)
    B, S = tokens.shape
    results = {k: _unpadded(k, np.asarray(v), B, S)
               for k, v in program(self.params, *placed).items()}
    missing = [n for n in exact if n not in results]
    if missing:
      raise ValueError(f"sites {missing} are not in this model's forward (e.g. attention sites "
                       f"of a layer without softmax attention)")
    unbatch = (lambda a: a[0]) if not batched else (lambda a: a)
    trace = Trace(tokens=unbatch(tokens), lengths=lengths if batched else None,
                  heads=heads_)
    if prepared is not None and prepared.mm_token_type_ids is not None:
      types = np.zeros(tokens.shape, np.int32)
      for i, row in enumerate(prepared.mm_token_type_ids):
        types[i, :len(row)] = row
      trace.mm_token_type_ids = unbatch(types)
      trace.image_grids = (prepared.image_grids or [[]])[0] if not batched else \
          prepared.image_grids
    L = self.num_layers
    chosen = set(range(L) if layers is None else layers)
    if "hidden_states" in capture:
      keys = ["resid_pre.0", *(f"resid_post.{l}" for l in range(L - 1)), "final_norm_out"]
      trace.hidden_states = [unbatch(results[k]) if (i == 0 or i - 1 in chosen) else None
                             for i, k in enumerate(keys)]
    if "attentions" in capture:
      with_attention = sorted(int(n.split(".")[1]) for n in self._reached[key]
                              if n.startswith("attn_pattern."))
      trace.attention_layers = with_attention
      trace.attentions = [unbatch(results[f"attn_pattern.{l}"]) if l in chosen else None
                          for l in with_attention]
    if "logits" in capture:
      trace.logits = unbatch(results["logits"])
    explicit = {n for c in capture if c not in HIGH_LEVEL for n in sites.expand(c, L)}
    trace.sites = {k: unbatch(v) for k, v in results.items() if k in explicit}
    trace.encoding = encoding
    if to == "torch":
      from MaxText.inspect.torch_boundary import to_torch  # torch is imported here only
      return to_torch(trace)
    return trace

  def _forward_inputs(self, token_ids, images, audio, tensors):
    """(the Encoding of a single prompt or None, the ids to run, the Prepared of media prompts)."""
    if isinstance(token_ids, enc_lib.Encoding):
      if token_ids.token_types.any():
        raise ValueError("an Encoding with image / audio tokens: give forward the prompt with its "
                         "images / audio instead (their tensors are not in the Encoding)")
      return token_ids, list(token_ids.ids), None
    single_prompt = isinstance(token_ids, str) or (isinstance(token_ids, dict) and not tensors)
    if single_prompt and self.inference.tokenizer is not None:
      encoding, prepared = self._encode(token_ids, images, audio, None, None, None, tensors)
      return encoding, encoding.ids, (prepared if prepared.media is not None else None)
    token_ids, prepared = self._prepared(token_ids, images, audio, tensors)
    return None, token_ids, prepared

  @locked
  def program_memory(self, length: int, capture: Iterable[str] = HIGH_LEVEL,
                     layers: Sequence[int] | None = None, heads: Sequence[int] | None = None,
                     batch: int = 1) -> dict[str, int]:
    """XLA's count of the compiled forward's memory on one device for `batch` rows of `length`
    tokens (bytes): its arguments, outputs and temporaries. Compiles only (works on abstract
    parameters too): what a capture would cost before running it."""
    names, _ = self._site_names(_names(capture), layers)
    program, _ = self._program(names, self._heads(heads), dict(self._interventions))
    whole = NamedSharding(self.mesh, PartitionSpec())
    ids = jax.ShapeDtypeStruct((batch, length), jnp.int32, sharding=whole)
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                         sharding=getattr(a, "sharding", None)),
                          self.params)
    analysis = program.lower(params, ids, ids, ids, {}).compile().memory_analysis()
    if analysis is None:
      raise ValueError(f"program_memory: the {jax.default_backend()} backend gives no memory "
                       "analysis")
    return {"argument": int(analysis.argument_size_in_bytes),
            "output": int(analysis.output_size_in_bytes),
            "temp": int(analysis.temp_size_in_bytes)}

  # ---- gradients -----------------------------------------------------------------------------------
  @locked
  def grad(self, site: str, objective: Callable, token_ids, *, images=None, audio=None,
           **tensors) -> tuple[float, np.ndarray]:
    """(objective, d objective / d the value at `site`): `objective(logits)` a scalar JAX function
    of the logits ([S, V] for one sequence, [B, S, V] for a batch) of the forward with the active
    interventions; the gradient has the site's shape ([S, D] for a residual site of one sequence)."""
    if len(sites.expand(site, self.num_layers)) != 1 or "*" in site:
      raise ValueError(f"grad needs one site, got {site!r}")
    token_ids, prepared = self._prepared(token_ids, images, audio, tensors)
    batched, tokens, lengths = self._inputs(token_ids)
    placed = self._placed(tokens, lengths, prepared)
    shape_prog, _ = self._program((site,), None, dict(self._interventions))
    shapes = jax.eval_shape(shape_prog, self.params, *placed)
    if site not in shapes:
      raise ValueError(f"site {site!r} is not in this model's forward")
    delta = jnp.zeros(shapes[site].shape, shapes[site].dtype)
    program, _ = self._program((), None, dict(self._interventions), site, objective)
    value, g = program(delta, self.params, *placed, unbatched=not batched)
    g = np.asarray(g)
    return float(value), (g if batched else g[0])


def _unpadded(name: str, x: np.ndarray, B: int, S: int) -> np.ndarray:
  """A captured site's value without the bucket's padding rows and positions ([B, S, ...];
  attention sites [B, H, S, T])."""
  if sites.parse(name)[0] in sites.HEAD_SITES:
    return x[:B, :, :S, :S]
  return x[:B, :S]


def _names(capture: Iterable[str] | str) -> tuple[str, ...]:
  """What to capture, in a fixed order (one program per set): a name or an iterable of names."""
  return (capture,) if isinstance(capture, str) else tuple(sorted(set(capture)))
