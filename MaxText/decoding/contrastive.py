"""Contrastive decoding on an Engine's model and cache machinery: each prompt runs beside a
contrast prompt (instruction-contrastive decoding: the same request with a perturbed instruction;
visual-contrastive: a distorted image, given as the contrast row's media), and every step takes
the next token from the fused logits

    fused = (1 + alpha) * logits(prompt + tokens) - alpha * logits(contrast + tokens)

(greedy or sampled as `Sampling` says, on the fused logits). Both rows of a pair are rows of one
batch — their cache is the engine's cache for 2B rows, prefilled in one call and extended one
token per step in one call — and receive the same chosen token. The log-probability returned
with each token is under the prompt's own distribution (log_softmax of its logits), as the
engine's. A pair stops at an eos id or after `max_new_tokens`.

One program is compiled per (rows, prompt-length) bucket for the prefill and one per (rows,
cache length) for the step.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from MaxText.decoding import cache as cache_lib
from MaxText.decoding.engine import (MAX_EOS_IDS, MIN_PROMPT_BUCKET, Completion, DecodeError,
                                     Engine, batch_media, bucket, fetch)
from MaxText.decoding.sampling import Sampling, choose
from MaxText.sharding.rules import use_rules


def fuse(pos_BV, neg_BV, alpha):
  """The contrastive logits (module docstring), fp32."""
  return (1.0 + alpha) * pos_BV.astype(jnp.float32) - alpha * neg_BV.astype(jnp.float32)


class ContrastiveDecoder:
  """Contrastive generation with `engine`'s model, mesh and cache (module docstring)."""

  def __init__(self, engine: Engine):
    self.engine = engine
    self._prefill = jax.jit(engine._counted(self._prefill_fn), static_argnames=("static",
                                                                                "max_len"))
    self._step = jax.jit(engine._counted(self._step_fn), static_argnames=("static",),
                         donate_argnums=(1,))

  def _pick(self, logits_2BV, alpha, static, values, rows_B, counts_B):
    B = logits_2BV.shape[0] // 2
    pos_BV, neg_BV = logits_2BV[:B], logits_2BV[B:]
    tokens_B, _ = choose(fuse(pos_BV, neg_BV, alpha), static, values, rows_B, counts_B)
    logprobs_B = jnp.take_along_axis(jax.nn.log_softmax(pos_BV.astype(jnp.float32), axis=-1),
                                     tokens_B[:, None], axis=-1)[:, 0]
    return tokens_B, logprobs_B

  def _prefill_fn(self, params, tokens_2BS, lengths_2B, rows_B, alpha, values, media, *, static,
                  max_len):
    eng = self.engine
    R, S = tokens_2BS.shape
    specs = cache_lib.specs(eng.mcfg, R, max_len, eng.cache_dtype)
    with use_rules(eng.mesh, eng.rules):
      model = eng._model(params)
      cache = cache_lib.constrain_cache(cache_lib.empty(specs), specs, eng.mesh, eng.rules)
      x, cache = model.extend(tokens_2BS, *eng._prompt_positions(lengths_2B, S), cache,
                              prefill=True, **eng._media(media))
      last = jnp.take_along_axis(x, (lengths_2B - 1)[:, None, None], axis=1)
      tokens_B, logprobs_B = self._pick(model.logits(last)[:, 0], alpha, static, values, rows_B,
                                        jnp.zeros_like(rows_B))
      cache = cache_lib.constrain_cache(cache, specs, eng.mesh, eng.rules)
    return cache, *eng._replicated(tokens_B, logprobs_B)

  def _step_fn(self, params, cache, tokens_B, positions_2B, active_B, rows_B, counts_B, alpha,
               values, *, static):
    eng = self.engine
    specs = cache_lib.specs(eng.mcfg, 1, 1, eng.cache_dtype)      # the logical axes
    active_2B = jnp.concatenate([active_B, active_B])
    with use_rules(eng.mesh, eng.rules):
      model = eng._model(params)
      x, cache = model.extend(jnp.concatenate([tokens_B, tokens_B])[:, None],
                              positions_2B[:, None], active_2B[:, None], cache, prefill=False)
      tokens_B, logprobs_B = self._pick(model.logits(x)[:, 0], alpha, static, values, rows_B,
                                        counts_B)
      cache = cache_lib.constrain_cache(cache, specs, eng.mesh, eng.rules)
    return cache, *eng._replicated(tokens_B, logprobs_B)

  def generate(self, params, prompts: Sequence[Sequence[int]],
               contrasts: Sequence[Sequence[int]], *, alpha: float, max_new_tokens: int,
               sampling: Sampling = Sampling(), eos_ids: Sequence[int] = (),
               media: Sequence[dict] | None = None,
               contrast_media: Sequence[dict] | None = None) -> list[Completion]:
    """One completion per (prompt, contrast) pair, in order (token ids; `media` / `contrast_media`
    each row's image / audio tensors)."""
    eng = self.engine
    for _, problem in sampling.problems():
      raise DecodeError(problem)
    if len(prompts) != len(contrasts):
      raise DecodeError(f"{len(prompts)} prompts but {len(contrasts)} contrast prompts")
    if len(eos_ids) > MAX_EOS_IDS:
      raise DecodeError(f"at most {MAX_EOS_IDS} eos ids, got {len(eos_ids)}")
    if not alpha >= 0:
      raise DecodeError(f"alpha={alpha} must be >= 0 (0: the prompt alone)")
    if not prompts:
      return []
    max_len = eng.cache_length([*prompts, *contrasts], max_new_tokens)
    params = eng.run_params(params)
    out: list[Completion] = []
    half = max(1, eng.batch_size // 2)
    for start in range(0, len(prompts), half):
      idx = list(range(start, min(start + half, len(prompts))))
      both = batch_media([*(media or [{}] * len(prompts)),
                          *(contrast_media or [{}] * len(prompts))],
                         [*idx, *(len(prompts) + i for i in idx)]) if media or contrast_media \
          else {}
      out += self._batch(params, [prompts[i] for i in idx], [contrasts[i] for i in idx], idx,
                         max_len, max_new_tokens, float(alpha), sampling, set(eos_ids), both)
    return out

  def _batch(self, params, prompts, contrasts, rows, max_len, max_new, alpha, sampling, eos,
             media) -> list[Completion]:
    eng = self.engine
    n, B = len(prompts), bucket(len(prompts))
    S = bucket(max(map(len, [*prompts, *contrasts])), MIN_PROMPT_BUCKET, max_len)
    tokens = np.zeros((2 * B, S), np.int32)
    lengths = np.ones(2 * B, np.int32)
    for b, (p, c) in enumerate(zip(prompts, contrasts)):
      tokens[b, :len(p)], tokens[B + b, :len(c)] = p, c
      lengths[b], lengths[B + b] = len(p), len(c)
    rows_B = np.zeros(B, np.int32)
    rows_B[:n] = rows
    values, static = sampling.values(), sampling.static
    alpha32 = np.float32(alpha)
    cache, tok_B, lp_B = self._prefill(params, *eng._host(tokens, lengths, rows_B, alpha32,
                                                          values, media),
                                       static=static, max_len=max_len)
    results = [Completion(list(p)) for p in prompts]
    positions = lengths.copy()
    active = np.zeros(B, bool)
    active[:n] = True
    counts = np.zeros(B, np.int32)
    while True:
      # host arrays handed to a call may be aliased by it (CPU device_put is zero-copy) while it
      # runs asynchronously: each step works on fresh arrays, never on ones already sent
      tok_B, lp_B, active = fetch(tok_B), fetch(lp_B), active.copy()
      for b in np.nonzero(active)[0]:
        c = results[b]
        c.output_ids.append(int(tok_B[b]))
        c.output_logprobs.append(float(lp_B[b]))
        if int(tok_B[b]) in eos:
          c.finish_reason, active[b] = "eos", False
        elif len(c.output_ids) >= max_new:
          active[b] = False
      if not active.any():
        return results
      counts = counts + active
      cache, tok_B, lp_B = self._step(
          params, cache, *eng._host(tok_B.astype(np.int32), positions, active, rows_B, counts,
                                    alpha32, values), static=static)
      positions = positions + np.concatenate([active, active])
