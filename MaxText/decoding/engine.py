"""Compiled decoding and scoring of one model under a mesh and its logical-axis rules (the
training mesh: batch over the data axes, heads and MLP over tensor, experts over expert).
Parameters are an argument of every call, so one engine serves a trainer's changing parameters
and a loaded checkpoint alike.

generate: the prompts (token ids) are sorted by length and cut into batches of `batch_size`; each
batch is padded to a bucket — rows to a power of two, prompt length to a power of two (>= 16) —
and prefilled in one call (the family's `extend(prefill=True)`: the training attention op over
the new tokens, flash where the platform has it), which also samples each row's first token.
Then one token per step for all rows (`extend` over the cache), `chunk` steps per call inside a
`while_loop` that ends as soon as every row is done; rows that finished (eos id,
`max_new_tokens`, or a stop string, which the host checks between calls) no longer write to the
cache or produce tokens. The cache length is one bucket per request (the longest prompt +
max_new_tokens, rounded up to a power of two, or `max_cache_length`), so a request compiles one
prefill per (row, prompt-length) bucket and one decoding program per row bucket.

score: log-probabilities of given completions after given prompts (a teacher-forced `extend`
without a cache; the head applied `SCORE_CHUNK` positions at a time so the [B, S, V] logits never
exist whole); `score_top` also gives the `top` most likely tokens at each completion position and
their log-probabilities (is the completion what greedy decoding writes: lm-eval's `is_greedy`).

Images and audio (a family whose `media` names them): each prompt's tensors (transformers' names,
MaxText/data/multimodal/processor.py) go with it; a batch's are concatenated in row order and
handed to the model's `extend` as `media=` in the prefill and in scoring (the decoding steps see
only the cache), so the soft tokens are computed once per prompt.

With `speculative_tokens` = k > 0 (a model with an MTP head, greedy decoding), each batch decodes
speculatively instead (MaxText/decoding/speculative.py): k tokens drafted by the MTP head,
verified in one forward of the model, the same output as plain greedy decoding.

Parameters: the model's own layout, or restacked per layer (MaxText/decoding/layout.py: a scanned
stack's layers as arrays of their own, so a decoding step reads each weight in place instead of a
loop that slices every layer's weights out of the stack on every step). Each program runs the
model whose parameters it is given; with `unroll_layers` parameters in the scanned layout are
restacked per call (`run_params`; the tools restack once, at load: `decode_unroll_layers`).

Requests that cannot run (an empty prompt, ids outside the vocabulary, a prompt plus
max_new_tokens longer than the cache or the model's positions) raise `DecodeError` naming the
prompt and the numbers, before anything compiles.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence, cast

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from MaxText.decoding import cache as cache_lib
from MaxText.decoding.layout import Layout
from MaxText.decoding.requests import MIN_PROMPT_BUCKET, Completion, bucket, fetch
from MaxText.decoding.sampling import Sampling, choose
from MaxText.decoding.speculative import Speculative
from MaxText.models.model_config import ModelConfig
from MaxText.models.registry import make_model_def
from MaxText.sharding.rules import Rules, tree_shardings, use_rules

SCORE_CHUNK = 256
MAX_EOS_IDS = 8      # eos ids go in as a fixed-size array (padded with -1): no recompile per count


class DecodeError(ValueError):
  """A request that cannot be decoded; the message names the prompt and the numbers."""


def batch_media(media: Sequence[dict[str, np.ndarray]] | None, rows: Sequence[int]
                ) -> dict[str, np.ndarray]:
  """The images and clips of the prompts `rows`, in that order: each tensor concatenated over the
  rows that have it ({} for text)."""
  if not media:
    return {}
  names = dict.fromkeys(n for i in rows for n in media[i])
  return {n: np.concatenate([media[i][n] for i in rows if n in media[i]]) for n in names}


class Engine:
  """Decoding programs for `mcfg` on `mesh` with `rules` (see the module docstring)."""

  def __init__(self, mcfg: ModelConfig, mesh: Mesh, rules: Rules, *, cache_dtype: str = "auto",
               batch_size: int = 8, max_cache_length: int = 0, chunk: int = 16,
               speculative_tokens: int = 0, unroll_layers: bool = False):
    cache_lib.groups(mcfg)   # refuses a family that does not decode
    if speculative_tokens and not mcfg.mtp_num_layers:
      raise DecodeError(f"speculative_tokens={speculative_tokens} drafts with the model's "
                        "multi-token-prediction head, but this model has none (mtp_num_layers=0)")
    self.mcfg = dataclasses.replace(mcfg, remat_policy="none")   # nothing to differentiate
    self.mesh, self.rules = mesh, rules
    self.model_def = make_model_def(self.mcfg)
    self.param_shardings = tree_shardings(self.model_def.logical_axes,
                                          self.model_def.abstract_params, mesh, rules)
    self.cache_dtype = cache_lib.cache_dtype(cache_dtype, mcfg.dtype,
                                             mesh.devices.flat[0].platform)
    self.batch_size, self.max_cache_length, self.chunk = batch_size, max_cache_length, chunk
    self.layout = Layout(self.mcfg, self.model_def)
    self.unroll_layers = unroll_layers and self.mcfg.scan_layers
    self._traces = 0   # programs traced (so compiled) by this engine's jitted functions
    self._prefill = jax.jit(self._counted(self._prefill_fn), static_argnames=("static", "max_len"))
    self._decode = jax.jit(self._counted(self._decode_fn), static_argnames=("static",),
                           donate_argnums=(1,))
    self._score = jax.jit(self._counted(self._score_fn), static_argnames=("top",))
    self.speculative = (Speculative(self, speculative_tokens, rounds=max(1, chunk // 2))
                        if speculative_tokens else None)

  def _counted(self, fn: Callable) -> Callable:
    """`fn`, counting its traces (jit traces a function once per program it compiles for it),
    traced on the model's hot path and matmul precision (`ModelDef.traced`)."""
    @functools.wraps(fn)
    def traced(*args, **kwargs):
      self._traces += 1
      with self.model_def.traced():
        return fn(*args, **kwargs)
    return traced

  # ---- parameters --------------------------------------------------------------------------------
  def place(self, params):
    """Host (NumPy) parameters → device arrays with this mesh's parameter shardings, in the
    model's dtypes (weight_dtype: e.g. float32 arrays cast to bfloat16 on the host); parameters
    in the per-layer layout (`layout.Layout`) placed with its shardings (`run_shardings`)."""
    d = self.layout.def_of(params)
    shardings = self.param_shardings if d is self.model_def else self.run_shardings
    params = jax.tree.map(lambda x, a: x if x.dtype == a.dtype else np.asarray(x).astype(a.dtype),
                          params, d.abstract_params)
    return jax.device_put(params, shardings)

  @functools.cached_property
  def run_shardings(self):
    """The shardings of the per-layer parameters (`layout.unscanned_def`'s)."""
    d = self.layout.unscanned_def
    return tree_shardings(d.logical_axes, d.abstract_params, self.mesh, self.rules)

  def per_layer(self, params, consume: bool = False):
    """`params` (placed, either layout) restacked per layer (module docstring); `consume`: the
    scanned arrays are deleted as they are cut (the caller keeps no reference to them)."""
    return self.layout.per_layer(params, self.run_shardings, consume)

  def run_params(self, params):
    """The parameters a request runs with: restacked per layer with `unroll_layers`, else as
    given (either layout)."""
    return self.per_layer(params) if self.unroll_layers else params

  def _host(self, *trees):
    """Host values (the same on every process) as arrays replicated over the mesh: what the
    compiled programs take in a multi-process run, with one sharding whatever the call."""
    return jax.device_put(trees, NamedSharding(self.mesh, PartitionSpec()))

  def _replicated(self, *trees):
    """Small results pinned replicated (inside a program): every process can read them whole."""
    whole = NamedSharding(self.mesh, PartitionSpec())
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, whole), trees)

  def compiled_programs(self) -> int:
    """Programs compiled so far by this engine."""
    return self._traces

  # ---- checks ------------------------------------------------------------------------------------
  def _check_ids(self, what: str, ids: Sequence[int], i: int) -> None:
    if len(ids) == 0:
      raise DecodeError(f"{what} {i} is empty: decoding needs at least one token to start from")
    bad = [t for t in ids if not 0 <= t < self.mcfg.vocab_size]
    if bad:
      raise DecodeError(f"{what} {i} holds token ids outside the vocabulary [0, "
                        f"{self.mcfg.vocab_size}): {bad[:5]}")

  def cache_bytes_per_device(self, rows: int, max_len: int) -> int:
    """The most cache one device holds for a batch of `rows` prompts with a cache of `max_len`
    positions (rows in batches of `batch_size`, padded to their bucket, as `generate` runs)."""
    specs = cache_lib.specs(self.mcfg, bucket(min(rows, self.batch_size)), max_len,
                            self.cache_dtype)
    return cache_lib.nbytes(specs, self.mesh, self.rules)

  def cache_length(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> int:
    """The cache length of a request; DecodeError when a prompt cannot fit."""
    positions = self.mcfg.max_position_embeddings
    if max_new_tokens < 1:
      raise DecodeError(f"max_new_tokens={max_new_tokens} must be >= 1")
    for i, p in enumerate(prompts):
      self._check_ids("prompt", p, i)
      for limit, name in ((self.max_cache_length, "max_cache_length"),
                          (positions, "the model's max_position_embeddings")):
        if limit and len(p) >= limit:
          raise DecodeError(f"prompt {i} has {len(p)} tokens; {name} is {limit}, which must "
                            f"exceed the prompt")
        if limit and len(p) + max_new_tokens > limit:
          raise DecodeError(f"prompt {i} ({len(p)} tokens) + max_new_tokens={max_new_tokens} = "
                            f"{len(p) + max_new_tokens} positions overflow {name} ({limit}); "
                            f"lower max_new_tokens to at most {limit - len(p)}")
    if self.max_cache_length:
      return self.max_cache_length
    return bucket(max(len(p) for p in prompts) + max_new_tokens, 64, positions)

  # ---- compiled programs -------------------------------------------------------------------------
  def _model(self, params):
    """The model of `params`' layout (scanned or per layer) with them."""
    return nnx.merge(self.layout.def_of(params).graphdef, params)

  @staticmethod
  def _prompt_positions(lengths_B, S: int):
    """(positions 0..S-1 [B, S], which are real tokens [B, S]) of right-padded prompts."""
    positions_BS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (lengths_B.shape[0], S))
    return positions_BS, positions_BS < lengths_B[:, None]

  @staticmethod
  def _media(media: dict) -> dict:
    """`extend`'s keyword for a batch's images and clips (none for a text batch)."""
    return {"media": media} if media else {}

  def _prefill_fn(self, params, tokens_BS, lengths_B, rows_B, values, media, *, static, max_len):
    B, S = tokens_BS.shape
    specs = cache_lib.specs(self.mcfg, B, max_len, self.cache_dtype)
    with use_rules(self.mesh, self.rules):
      model = self._model(params)
      cache = cache_lib.constrain_cache(cache_lib.empty(specs), specs, self.mesh, self.rules)
      x_BSD, cache = model.extend(tokens_BS, *self._prompt_positions(lengths_B, S), cache,
                                  prefill=True, **self._media(media))
      last_B1D = jnp.take_along_axis(x_BSD, (lengths_B - 1)[:, None, None], axis=1)
      tokens_B, logprobs_B = choose(model.logits(last_B1D)[:, 0], static, values, rows_B,
                                    jnp.zeros_like(rows_B))
      cache = cache_lib.constrain_cache(cache, specs, self.mesh, self.rules)
    return cache, *self._replicated(tokens_B, logprobs_B)

  def _decode_fn(self, params, cache, state, eos_E, max_new, values, *, static):
    """Up to `chunk` steps for all rows; stops early once every row is done. state: the token
    each row feeds next (`token`), its position, tokens generated (`count`), `done`, `row`."""
    B, C = state["token"].shape[0], self.chunk
    specs = cache_lib.specs(self.mcfg, 1, 1, self.cache_dtype)   # the logical axes
    with use_rules(self.mesh, self.rules):
      model = self._model(params)

      def step(carry):
        i, cache, st, out_tokens, out_logprobs = carry
        active_B = ~st["done"]
        x_B1D, cache = model.extend(st["token"][:, None], st["position"][:, None],
                                    active_B[:, None], cache, prefill=False)
        tokens_B, logprobs_B = choose(model.logits(x_B1D)[:, 0], static, values, st["row"],
                                      st["count"])
        out_tokens = out_tokens.at[:, i].set(jnp.where(active_B, tokens_B, -1))
        out_logprobs = out_logprobs.at[:, i].set(jnp.where(active_B, logprobs_B, 0.0))
        count_B = st["count"] + active_B
        finished_B = jnp.any(tokens_B[:, None] == eos_E[None, :], axis=1) | (count_B >= max_new)
        st = {"token": jnp.where(active_B, tokens_B, st["token"]),
              "position": st["position"] + active_B, "count": count_B,
              "done": st["done"] | (active_B & finished_B), "row": st["row"]}
        return i + 1, cache, st, out_tokens, out_logprobs

      init = (jnp.int32(0), cache, state, jnp.full((B, C), -1, jnp.int32),
              jnp.zeros((B, C), jnp.float32))
      _, cache, state, out_tokens, out_logprobs = jax.lax.while_loop(
          lambda c: (c[0] < C) & ~jnp.all(c[2]["done"]), step, init)
      cache = cache_lib.constrain_cache(cache, specs, self.mesh, self.rules)
    return cache, *self._replicated(state, out_tokens, out_logprobs)

  def _score_fn(self, params, tokens_BS, targets_BS, lengths_B, media, *, top: int = 0):
    """log p(targets[b, s] | tokens[b, :s+1]) for s < lengths[b] (0 beyond); with `top` also the
    `top` most likely tokens at each position and their log-probabilities."""
    B, S = tokens_BS.shape
    C = min(S, SCORE_CHUNK)
    with use_rules(self.mesh, self.rules):
      model = self._model(params)
      positions_BS, valid_BS = self._prompt_positions(lengths_B, S)
      x_BSD, _ = model.extend(tokens_BS, positions_BS, valid_BS, None, prefill=True,
                              **self._media(media))

      def chunk_logprobs(xs):
        x_BCD, t_BC = xs
        logp_BCV = jax.nn.log_softmax(model.logits(x_BCD), axis=-1)
        lp_BC = jnp.take_along_axis(logp_BCV, t_BC[..., None], axis=-1)[..., 0]
        if not top:
          return lp_BC
        top_lp_BCK, top_ids_BCK = jax.lax.top_k(logp_BCV, top)
        return lp_BC, top_ids_BCK.astype(jnp.int32), top_lp_BCK

      split = lambda a: a.reshape(B, S // C, C, *a.shape[2:]).swapaxes(0, 1)
      merge = lambda a: a.swapaxes(0, 1).reshape(B, S, *a.shape[3:])
      out = jax.lax.map(chunk_logprobs, (split(x_BSD), split(targets_BS)))
      if not top:
        return self._replicated(jnp.where(valid_BS, merge(out), 0.0))[0]
      lp_NBC, ids_NBCK, top_NBCK = out
      return self._replicated(jnp.where(valid_BS, merge(lp_NBC), 0.0), merge(ids_NBCK),
                              merge(top_NBCK))

  # ---- requests ----------------------------------------------------------------------------------
  def generate(self, params, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
               sampling: Sampling = Sampling(), eos_ids: Sequence[int] = (),
               stop: Sequence[str] = (), detokenize: Callable[[list[int]], str] | None = None,
               row_ids: Sequence[int] | None = None,
               media: Sequence[dict[str, np.ndarray]] | None = None) -> list[Completion]:
    """Completions of `prompts` (token ids), in order. `stop` strings need `detokenize` (ids →
    text). `row_ids` (default: the prompts' indices) seed each prompt's samples. `media`: each
    prompt's image / audio tensors (module docstring)."""
    for _, problem in sampling.problems():
      raise DecodeError(problem)
    if self.speculative is not None and (not sampling.static[0] or any(media or ())):
      raise DecodeError(f"speculative_tokens={self.speculative.k} decodes greedily and text only: "
                        "set temperature=0 (and no images or audio), or speculative_tokens=0")
    if len(eos_ids) > MAX_EOS_IDS:
      raise DecodeError(f"at most {MAX_EOS_IDS} eos ids, got {len(eos_ids)}")
    if stop and detokenize is None:
      raise DecodeError("stop strings need a tokenizer to read the completions' text")
    prompts = [[int(t) for t in p] for p in prompts]
    if media is not None and len(media) != len(prompts):
      raise DecodeError(f"{len(prompts)} prompts but media for {len(media)}")
    if not prompts:
      return []
    max_len = self.cache_length(prompts, max_new_tokens)
    params = self.run_params(params)
    row_ids = list(range(len(prompts))) if row_ids is None else list(row_ids)
    eos_E = np.full(MAX_EOS_IDS, -1, np.int32)
    eos_E[:len(eos_ids)] = eos_ids
    out: list[Completion | None] = [None] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    for start in range(0, len(order), self.batch_size):
      idx = order[start:start + self.batch_size]
      if self.speculative is not None:
        done = self.speculative.generate_batch(params, [prompts[i] for i in idx], max_len,
                                               max_new_tokens, eos_E, tuple(stop), detokenize)
      else:
        done = self._generate_batch(params, [prompts[i] for i in idx],
                                    [row_ids[i] for i in idx], max_len, max_new_tokens,
                                    sampling, eos_E, tuple(stop), detokenize,
                                    batch_media(media, idx))
      for i, c in zip(idx, done):
        out[i] = c
    return cast(list[Completion], out)  # every row filled

  def _generate_batch(self, params, prompts, rows, max_len, max_new, sampling, eos_E, stop,
                      detokenize, media) -> list[Completion]:
    n = len(prompts)
    B = bucket(n)
    S = bucket(max(len(p) for p in prompts), MIN_PROMPT_BUCKET, max_len)
    tokens_BS = np.zeros((B, S), np.int32)
    lengths_B = np.ones(B, np.int32)
    rows_B = np.zeros(B, np.int32)
    for b, p in enumerate(prompts):
      tokens_BS[b, :len(p)] = p
      lengths_B[b], rows_B[b] = len(p), rows[b]
    values = sampling.values()
    cache, first_B, first_lp_B = self._prefill(params, *self._host(tokens_BS, lengths_B, rows_B,
                                                                  values, media),
                                               static=sampling.static, max_len=max_len)
    first_B, first_lp_B = fetch(first_B), fetch(first_lp_B)
    results = [Completion(list(p), [int(first_B[b])], [float(first_lp_B[b])])
               for b, p in enumerate(prompts)]
    done_B = np.ones(B, bool)
    for b, c in enumerate(results):
      done_B[b] = self._finished(c, eos_E, max_new, stop, detokenize, checked=0)
    state = {"token": first_B.astype(np.int32), "position": lengths_B.copy(),
             "count": np.ones(B, np.int32), "done": done_B, "row": rows_B}
    while not done_B.all():
      checked = [len(c.output_ids) for c in results]
      cache, state, out_tokens, out_logprobs = self._decode(
          params, cache, *self._host(state, eos_E, np.int32(max_new), values),
          static=sampling.static)
      state = self._collect(results, out_tokens, out_logprobs, state, checked,
                            eos_E, max_new, stop, detokenize)
      done_B = state["done"]
    return results

  def _collect(self, results, out_tokens, out_logprobs, state, checked, eos_E, max_new, stop,
               detokenize):
    """Appends one decoding call's tokens (-1: none) and log-probabilities to each row's
    Completion and marks the rows that finished (eos, stop string, max_new_tokens); returns the
    loop state as host arrays (as it first went in: one program, not two)."""
    out_tokens, out_logprobs = fetch(out_tokens), fetch(out_logprobs)
    state = {k: fetch(v) for k, v in state.items()}
    done_B = state["done"].copy()
    for b, c in enumerate(results):
      new = out_tokens[b] >= 0
      c.output_ids += out_tokens[b, new].tolist()
      c.output_logprobs += out_logprobs[b, new].tolist()
      if new.any():
        done_B[b] = self._finished(c, eos_E, max_new, stop, detokenize, checked[b])
    return {**state, "done": done_B}

  @staticmethod
  def _finished(c: Completion, eos_E, max_new, stop, detokenize, checked: int) -> bool:
    """Whether `c` is done (setting its finish reason; a stop string cuts the completion after
    the token that completes it). `checked`: tokens already searched for stop strings."""
    if stop:
      for j in range(checked + 1, len(c.output_ids) + 1):
        text = detokenize(c.output_ids[:j])
        if any(s in text for s in stop):
          del c.output_ids[j:], c.output_logprobs[j:]
          c.finish_reason = "stop"
          return True
    if c.output_ids[-1] in eos_E[eos_E >= 0]:
      c.finish_reason = "eos"
      return True
    return len(c.output_ids) >= max_new

  def score(self, params, prompts: Sequence[Sequence[int]],
            completions: Sequence[Sequence[int]],
            media: Sequence[dict[str, np.ndarray]] | None = None) -> list[np.ndarray]:
    """Per completion, the log-probability of each of its tokens given the prompt and the
    completion's earlier tokens (fp32 arrays of len(completion)); `media` as for `generate`."""
    return [lp for lp, _, _ in self._scored(params, prompts, completions, 0, media)]

  def score_top(self, params, prompts: Sequence[Sequence[int]],
                completions: Sequence[Sequence[int]], top: int,
                media: Sequence[dict[str, np.ndarray]] | None = None
                ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """`score`'s log-probabilities with, at each completion position, the `top` most likely
    tokens there (the first of equals first, as argmax) and their log-probabilities: (logprobs
    [C], top ids [C, top], top logprobs [C, top]) per completion."""
    if not 1 <= top <= self.mcfg.vocab_size:
      raise DecodeError(f"top={top} must be in [1, {self.mcfg.vocab_size}]")
    return self._scored(params, prompts, completions, top, media)

  def _scored(self, params, prompts, completions, top: int, media=None):
    if len(prompts) != len(completions):
      raise DecodeError(f"{len(prompts)} prompts but {len(completions)} completions")
    seqs = []
    for i, (p, c) in enumerate(zip(prompts, completions)):
      self._check_ids("prompt", p, i)
      if len(c):
        self._check_ids("completion", c, i)
      seqs.append([int(t) for t in p] + [int(t) for t in c])
      # the last token is only a target: the model reads the others, one position each
      if len(seqs[-1]) - 1 > self.mcfg.max_position_embeddings:
        raise DecodeError(f"prompt {i} + completion = {len(seqs[-1])} tokens exceed the model's "
                          f"max_position_embeddings ({self.mcfg.max_position_embeddings}) + 1 "
                          f"(the last is only scored)")
    params = self.run_params(params)
    none = np.zeros((0, top), np.int32), np.zeros((0, top), np.float32)
    out: list[tuple] = [(np.zeros(0, np.float32), *none)] * len(seqs)
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
    for start in range(0, len(order), self.batch_size):
      idx = order[start:start + self.batch_size]
      B = bucket(len(idx))
      S = bucket(max(len(seqs[i]) - 1 for i in idx), MIN_PROMPT_BUCKET)
      if S > SCORE_CHUNK:
        S = -(-S // SCORE_CHUNK) * SCORE_CHUNK
      tokens_BS, targets_BS = np.zeros((B, S), np.int32), np.zeros((B, S), np.int32)
      lengths_B = np.ones(B, np.int32)
      for b, i in enumerate(idx):
        s = seqs[i]
        tokens_BS[b, :len(s) - 1], targets_BS[b, :len(s) - 1] = s[:-1], s[1:]
        lengths_B[b] = max(len(s) - 1, 1)
      got = self._score(params, *self._host(tokens_BS, targets_BS, lengths_B,
                                            batch_media(media, idx)), top=top)
      lp_BS, ids_BSK, top_BSK = (fetch(got), *none) if not top else map(fetch, got)
      for b, i in enumerate(idx):
        at = slice(len(prompts[i]) - 1, len(prompts[i]) - 1 + len(completions[i]))
        out[i] = (lp_BS[b, at].astype(np.float32),
                  *((ids_BSK[b, at], top_BSK[b, at].astype(np.float32)) if top else none))
    return out
