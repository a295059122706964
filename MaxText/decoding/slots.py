"""Continuous batching's compiled programs: one cache of `slots` rows, each row a request's, that
requests enter and leave between decoding calls (the scheduler is MaxText/serve/scheduler.py).

The cache is the family's own (MaxText/decoding/cache.py, every kind: full attention, sliding
rings, KV-shared layers, the Gated DeltaNet state), `slots` rows of `max_len` positions; a row is
found by the logical axis "activation_batch" of each array, so nothing here knows a kind.

`prefill`: new prompts (right-padded to a length bucket: 16, 24, 32, 48, ...; rows to a power of
two) run through the family's `extend(prefill=True)` into a fresh cache of their own, which is
then written into their slots of the shared cache (rows padded in go to slot `slots`: dropped);
each row's first token is chosen. `step`: up to `chunk` decoding steps of the busy slots
(`extend` over their rows of the shared cache: gathered, padded with done rows to a power of two,
and scattered back after; every slot's row in place once that power of two reaches `slots`, so a
call costs what its busy slots need, not what all the slots would: `step_rows`; at least
`min_rows` rows, fewer programs where a few rows cost what one does: a TPU), a `while_loop`
that ends as soon as every slot is done, and after any
step once a slot finished (its answer ends and its slot frees now, not after the others' steps)
or once `interrupt` (a host callback asked between steps) says a request waits for a free slot
(it is admitted after one step, not after a whole call; a callback costs a host round trip per
step: `interrupt` None asks none); a slot that is done (empty, or its
request finished) writes nothing and produces -1. Where a call ends never changes a token. A call reads only the
first L positions of its rows (`window`: the least of 64, 96, 128, 192, ... that holds the
busiest slot after the call), cut from the cache before the loop and written back after it.
`step` is `launch` (dispatched, its results' copies to the host started) then `collect` (read
back); `follow` dispatches the next call over the same rows from a call's state on the device,
before anything is read back (the scheduler's overlap), its window `chunk` positions longer.
Its programs: row buckets x windows (x greedy / sampled, x top log-probabilities); `warm`
compiles the greedy ones without top log-probabilities up front (the server's `serve_warmup`).
A prompt may also go in pieces (`prefill` with `starts`), on every family: a piece after the
first is a multi-token step over its slot's cache (full attention: written, then each query
attends to the positions up to its own; a sliding ring widened by the piece's length for the
step and narrowed after it, `cache.widen` / `cache.narrow`, so no key a query needs is
overwritten; the Gated DeltaNet state continued from the cached conv window and delta-rule
state). Text only: a prompt with images or audio is prefilled whole.

Sampling is per row (`sample_rows`): each row has its own temperature (0 = greedy), top-k, top-p,
min-p and seed, so one program serves any mix; whether any row samples and how many most likely
tokens to report (`top`) are static, so a bucket compiles at most four programs. A row's sample
is the one `MaxText.decode` draws for the same seed, prompt index (`row`) and step: the same
filters, in the same order, and the same key (MaxText/decoding/sampling.py).
"""
# Slots extends the Engine (its model, placement and counted jit): its underscored helpers.
# pylint: disable=protected-access
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from MaxText.decoding import cache as cache_lib
from MaxText.decoding.engine import MAX_EOS_IDS, MIN_PROMPT_BUCKET, Engine, bucket, fetch
from MaxText.decoding.speculative import rolls_back_by_position
from MaxText.sharding.rules import use_rules

BATCH_AXIS = "activation_batch"
NEG_INF = -jnp.inf


def sample_rows(logits_BV: jax.Array, sampled: bool, values: dict, rows_B: jax.Array,
                steps_B: jax.Array, top: int) -> tuple[jax.Array, ...]:
  """(next token [B], its log-probability under the unmodified distribution [B], the `top` most
  likely tokens [B, top] and their log-probabilities [B, top]) with each row's own sampling
  values ([B] arrays: temperature (0 = greedy), top_k (0 = off), top_p (1 = off), min_p (0 =
  off), seed). The filters are sampling.filtered_logits', row by row."""
  logits_BV = logits_BV.astype(jnp.float32)
  tokens_B = jnp.argmax(logits_BV, axis=-1)
  if sampled:
    temperature_B = values["temperature"]
    z_BV = logits_BV / jnp.where(temperature_B > 0, temperature_B, 1.0)[:, None]
    V = z_BV.shape[-1]
    k_B = values["top_k"]
    desc_BV = -jnp.sort(-z_BV, axis=-1)
    kth_B1 = jnp.take_along_axis(desc_BV, (jnp.clip(k_B, 1, V) - 1)[:, None], axis=-1)
    z_BV = jnp.where((k_B[:, None] > 0) & (z_BV < kth_B1), NEG_INF, z_BV)
    p_B1 = values["top_p"][:, None]
    probs_BV = jax.nn.softmax(z_BV, axis=-1)
    desc_BV = -jnp.sort(-probs_BV, axis=-1)
    before_BV = jnp.cumsum(desc_BV, axis=-1) - desc_BV
    least_B1 = jnp.min(jnp.where(before_BV < p_B1, desc_BV, jnp.inf), axis=-1, keepdims=True)
    z_BV = jnp.where((p_B1 < 1) & (probs_BV < least_B1), NEG_INF, z_BV)
    m_B1 = values["min_p"][:, None]
    probs_BV = jax.nn.softmax(z_BV, axis=-1)
    floor_B1 = m_B1 * jnp.max(probs_BV, axis=-1, keepdims=True)
    z_BV = jnp.where((m_B1 > 0) & (probs_BV < floor_B1), NEG_INF, z_BV)
    keys_B = jax.vmap(lambda s, r, t: jax.random.fold_in(jax.random.fold_in(jax.random.key(s), r),
                                                          t))(values["seed"], rows_B, steps_B)
    gumbel_BV = jax.vmap(lambda k: jax.random.gumbel(k, (V,), jnp.float32))(keys_B)
    tokens_B = jnp.where(temperature_B > 0, jnp.argmax(z_BV + gumbel_BV, axis=-1), tokens_B)
  tokens_B = tokens_B.astype(jnp.int32)
  logp_BV = jax.nn.log_softmax(logits_BV, axis=-1)
  logprobs_B = jnp.take_along_axis(logp_BV, tokens_B[:, None], axis=-1)[:, 0]
  if top:
    top_lp_BK, top_ids_BK = jax.lax.top_k(logp_BV, top)
  else:
    top_lp_BK, top_ids_BK = jnp.zeros((logits_BV.shape[0], 0)), jnp.zeros((logits_BV.shape[0], 0))
  return tokens_B, logprobs_B, top_ids_BK.astype(jnp.int32), top_lp_BK.astype(jnp.float32)


def length_buckets(max_len: int, minimum: int = 64) -> list[int]:
  """Padded lengths: `minimum` times powers of two and the halves between them (64, 96, 128,
  192, 256, ...) below `max_len`, then `max_len`."""
  out, n = [], minimum
  while n < max_len:
    out += [n] + ([n * 3 // 2] if n * 3 // 2 < max_len else [])
    n *= 2
  return out + [max_len]


def row_values(rows: list[dict[str, Any]], n: int) -> dict[str, np.ndarray]:
  """The sampling values of `rows` (dicts of temperature, top_k, top_p, min_p, seed) as [n]
  arrays; rows beyond them greedy."""
  out = {"temperature": np.zeros(n, np.float32), "top_k": np.zeros(n, np.int32),
         "top_p": np.ones(n, np.float32), "min_p": np.zeros(n, np.float32),
         "seed": np.zeros(n, np.uint32)}
  for i, r in enumerate(rows):
    for k, a in out.items():
      a[i] = r[k]
  return out


@dataclass
class Call:
  """A decoding call (`Slots.launch` / `follow`): the busy slots it decodes (`busy`) in a row
  bucket of `rows`, its inputs on the device (eos ids, the rows' sampling values, their cache
  rows), the rows' state after it and its outputs (device arrays until `Slots.collect`), the
  most positions a row can reach by its end (`reach`: its cache window) and its static flags."""
  busy: np.ndarray
  rows: int
  inputs: tuple
  state: dict
  out: dict
  reach: int
  sampled: bool
  top: int


class Slots:
  """The shared cache of `slots` rows of `max_len` positions and the programs that fill and decode
  it, for the model of `engine` (module docstring). Not thread-safe: one thread calls it."""

  def __init__(self, engine: Engine, slots: int, max_len: int, chunk: int = 8, min_rows: int = 1):
    self.engine, self.slots, self.max_len, self.chunk = engine, slots, max_len, chunk
    # the fewest rows a decoding call runs (`step_rows`): on a TPU a step of a few rows costs what
    # a step of one row does (the weights' read): fewer row buckets, fewer programs to compile
    self.min_rows = max(1, min_rows)
    self.specs = cache_lib.specs(engine.mcfg, slots, max_len, engine.cache_dtype)
    self.lengths = length_buckets(max_len)
    self.prompt_lengths = length_buckets(max_len, MIN_PROMPT_BUCKET)
    self._prefill = jax.jit(engine._counted(self._prefill_fn),
                            static_argnames=("sampled", "top", "length"), donate_argnums=(1,))
    self._step = jax.jit(engine._counted(self._step_fn),
                         static_argnames=("sampled", "top", "length", "early"), donate_argnums=(1,))
    # asked on the host between two decoding steps of a call: True ends the call there (the
    # scheduler: a request waits for a free slot); None: calls run their steps (module docstring)
    self.interrupt: Callable[[], bool] | None = None
    self._copy = jax.jit(engine._counted(self._copy_fn), donate_argnums=(0,))
    # whether a row's first m positions are its first m tokens' cache whatever followed (full
    # attention only), or the row is only the state after all its tokens (rings, recurrences)
    self.positional = rolls_back_by_position(engine.mcfg)
    self.cache = jax.jit(self._empty_fn)()

  def _empty_fn(self):
    e = self.engine
    with use_rules(e.mesh, e.rules):
      return cache_lib.constrain_cache(cache_lib.empty(self.specs), self.specs, e.mesh, e.rules)

  def window(self, need: int) -> int:
    """The cache length a call reads to hold `need` positions: the least bucket >= need."""
    return next((n for n in self.lengths if n >= need), self.max_len)

  def step_length(self, positions: np.ndarray) -> int:
    """The cache length a decoding call reads: the least bucket that holds every busy slot's
    positions after `chunk` more tokens."""
    return self.window(int(positions.max(initial=0)) + self.chunk)

  def prompt_bucket(self, length: int) -> int:
    """The padded length of a prefill whose longest prompt has `length` tokens: 16, 24, 32, 48,
    ... (a third of a prefill's work padding at most, not half as with powers of two)."""
    return next((n for n in self.prompt_lengths if n >= length), self.max_len)

  def compiled_programs(self) -> int:
    return self.engine.compiled_programs()

  # ---- programs ----------------------------------------------------------------------------------
  def _insert(self, cache: dict, new: dict, slots_B) -> dict:
    """`cache` with the rows of `new` written into rows `slots_B` (a row >= slots: dropped); `new`
    may be shorter along its length axes: it goes into their first positions (the rest of those
    rows keeps what it held: never read, as attention reads positions up to a query's)."""
    out = {}
    for name, arrays in cache.items():
      out[name] = {}
      for k, x in arrays.items():
        y = new[name][k]
        axis = self.specs[name][k].logical_axes.index(BATCH_AXIS)
        at = tuple(slots_B if a == axis else slice(0, n) for a, n in enumerate(y.shape))
        out[name][k] = x.at[at].set(y.astype(x.dtype), mode="drop")
    return out

  def _window(self, cache: dict, length: int, rows: int = 0) -> dict:
    """The first `length` positions of every row (`rows` of them; 0: the slots): each array cut
    to its shape at that cache length (full attention: the first positions; a ring shorter than
    its window holds position p at slot p, so the same cut; fixed-size state: whole)."""
    short = cache_lib.specs(self.engine.mcfg, rows or self.slots, length, self.engine.cache_dtype)
    return {name: {k: x if x.shape == short[name][k].shape else
                   jax.lax.slice(x, (0,) * x.ndim, short[name][k].shape)
                   for k, x in arrays.items()} for name, arrays in cache.items()}

  @staticmethod
  def _put_back(cache: dict, window: dict) -> dict:
    return {name: {k: w if w.shape == cache[name][k].shape else
                   jax.lax.dynamic_update_slice(cache[name][k], w, (0,) * w.ndim)
                   for k, w in arrays.items()} for name, arrays in window.items()}

  def _rows(self, cache: dict, slots_B) -> dict:
    """The rows `slots_B` of `cache` (a row >= slots: the last one's copy, dropped on insert)."""
    at = jnp.minimum(slots_B, self.slots - 1)
    return {name: {k: jnp.take(x, at, axis=self.specs[name][k].logical_axes.index(BATCH_AXIS))
                   for k, x in arrays.items()} for name, arrays in cache.items()}

  def _prefill_fn(self, params, cache, tokens_BS, starts_B, lengths_B, slots_B, rows_B, values,
                  media, *, sampled, top, length):
    """Prompt pieces (`lengths_B` tokens each, right-padded to S) into their slots. `length` 0:
    first pieces (positions 0..), the family's prefill over a fresh cache of S positions. Else
    pieces that continue a prompt at positions `starts_B`..: each row's first `length` positions
    read from its slot and the piece run as a multi-token step over them (written, then each
    query attends to the positions up to its own; rings widened for the step, then narrowed,
    module docstring). Each row's next token is chosen after its piece's last token."""
    e = self.engine
    B, S = tokens_BS.shape
    with use_rules(e.mesh, e.rules):
      model = e._model(params)
      if not length:
        new_specs = cache_lib.specs(e.mcfg, B, S, e.cache_dtype)   # the prompts' positions only
        new = cache_lib.constrain_cache(cache_lib.empty(new_specs), new_specs, e.mesh, e.rules)
        x_BSD, new = model.extend(tokens_BS, *e._prompt_positions(lengths_B, S), new,
                                  prefill=True, **e._media(media))
      else:
        short = cache_lib.specs(e.mcfg, B, length, e.cache_dtype)
        new = cache_lib.widen(e.mcfg, self._window(self._rows(cache, slots_B), length, B), S,
                              starts_B)
        offsets_BS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
        x_BSD, new = model.extend(tokens_BS, starts_B[:, None] + offsets_BS,
                                  offsets_BS < lengths_B[:, None], new, prefill=False)
        new = cache_lib.narrow(e.mcfg, new, short)
      last_B1D = jnp.take_along_axis(x_BSD, (lengths_B - 1)[:, None, None], axis=1)
      picked = sample_rows(model.logits(last_B1D)[:, 0], sampled, values, rows_B,
                           jnp.zeros_like(rows_B), top)
      cache = cache_lib.constrain_cache(self._insert(cache, new, slots_B), self.specs, e.mesh,
                                        e.rules)
    return cache, *e._replicated(*picked)

  def _copy_fn(self, cache, source, slot):
    """`cache` with row `slot` a copy of row `source` (prefix caching, MaxText/serve/prefix.py)."""
    e = self.engine
    out = {}
    for name, arrays in cache.items():
      out[name] = {}
      for k, x in arrays.items():
        axis = self.specs[name][k].logical_axes.index(BATCH_AXIS)
        row = jax.lax.dynamic_index_in_dim(x, source, axis, keepdims=True)
        out[name][k] = jax.lax.dynamic_update_index_in_dim(x, row, slot, axis)
    with use_rules(e.mesh, e.rules):
      return cache_lib.constrain_cache(out, self.specs, e.mesh, e.rules)

  def _interrupted(self) -> np.ndarray:
    return np.asarray(self.interrupt is not None and bool(self.interrupt()))

  def _step_fn(self, params, full, state, eos_E, values, slots_B, *, sampled, top, length,
               early):
    """Up to `chunk` steps of the cache rows `slots_B` (B of them; B < slots: gathered, a row
    >= slots a padding row that is done, and scattered back after; else every slot in order)
    over their first `length` positions. state: per row the token it feeds next, its position,
    tokens generated (`count`), its `max_new`, `done` and `row` (its prompt index)."""
    e = self.engine
    B, C = state["token"].shape[0], self.chunk
    gathered = B < self.slots
    with use_rules(e.mesh, e.rules):
      model = e._model(params)
      cache = (self._window(self._rows(full, slots_B), length, B) if gathered
               else self._window(full, length))

      def step(carry):
        i, cache, st, out = carry
        active_B = ~st["done"]
        x_B1D, cache = model.extend(st["token"][:, None], st["position"][:, None],
                                    active_B[:, None], cache, prefill=False)
        tokens_B, lp_B, ids_BK, top_BK = sample_rows(model.logits(x_B1D)[:, 0], sampled, values,
                                                     st["row"], st["count"], top)
        out = {"tokens": out["tokens"].at[:, i].set(jnp.where(active_B, tokens_B, -1)),
               "logprobs": out["logprobs"].at[:, i].set(jnp.where(active_B, lp_B, 0.0)),
               "top_ids": out["top_ids"].at[:, i].set(ids_BK),
               "top_logprobs": out["top_logprobs"].at[:, i].set(top_BK)}
        count_B = st["count"] + active_B
        finished_B = (jnp.any(tokens_B[:, None] == eos_E[None, :], axis=1)
                      | (count_B >= st["max_new"]))
        st = {**st, "token": jnp.where(active_B, tokens_B, st["token"]),
              "position": st["position"] + active_B, "count": count_B,
              "done": st["done"] | (active_B & finished_B)}
        return i + 1, cache, st, out

      out = {"tokens": jnp.full((B, C), -1, jnp.int32), "logprobs": jnp.zeros((B, C), jnp.float32),
             "top_ids": jnp.zeros((B, C, top), jnp.int32),
             "top_logprobs": jnp.zeros((B, C, top), jnp.float32)}
      done0_B = state["done"]

      def more(c):
        i, _, st, _ = c
        # after the first step, a row that finished ends the call (its answer ends, its slot
        # frees), and so does a request waiting for a free slot (`interrupt`, asked on the host)
        go = (i < C) & ~jnp.all(st["done"]) & ~((i > 0) & jnp.any(st["done"] & ~done0_B))
        if early:
          go = go & ((i == 0) | ~io_callback(self._interrupted, jax.ShapeDtypeStruct((), jnp.bool_)))
        return go
      _, cache, state, out = jax.lax.while_loop(more, step, (jnp.int32(0), cache, state, out))
      cache = self._insert(full, cache, slots_B) if gathered else self._put_back(full, cache)
      cache = cache_lib.constrain_cache(cache, self.specs, e.mesh, e.rules)
    return cache, *e._replicated(state, out)

  # ---- calls -------------------------------------------------------------------------------------
  def prefill(self, params, prompts: list[list[int]], slots: list[int], rows: list[int],
              sampling: list[dict[str, Any]], top: int, starts: list[int] | None = None,
              media: dict[str, np.ndarray] | None = None) -> tuple[np.ndarray, ...]:
    """Prefills `prompts` (pieces of prompts beginning at positions `starts`: all 0, or all > 0)
    into `slots`; (next tokens, their log-probabilities, top ids, top log-probabilities), one
    row per prompt. `media`: the first pieces' images and clips
    (`batch_media` of theirs, whole prompts)."""
    params = self.engine.run_params(params)
    n = len(prompts)
    starts = starts or [0] * n
    B = bucket(n)
    S = self.prompt_bucket(max(len(p) for p in prompts))
    tokens_BS = np.zeros((B, S), np.int32)
    starts_B = np.zeros(B, np.int32)
    lengths_B = np.ones(B, np.int32)
    slots_B = np.full(B, self.slots, np.int32)
    rows_B = np.zeros(B, np.int32)
    for b, p in enumerate(prompts):
      tokens_BS[b, :len(p)] = p
      lengths_B[b], slots_B[b], rows_B[b], starts_B[b] = len(p), slots[b], rows[b], starts[b]
    length = 0
    if starts_B.any():
      if not starts_B[:n].all() or media:
        raise ValueError("prompt pieces continue together (text only)")
      length = self.window(int((starts_B + lengths_B)[:n].max()))
    values = row_values(sampling, B)
    e = self.engine
    self.cache, *got = self._prefill(params, self.cache, *e._host(
        tokens_BS, starts_B, lengths_B, slots_B, rows_B, values, media or {}),
                                     sampled=bool(values["temperature"].any()), top=top,
                                     length=length)
    return tuple(np.asarray(fetch(g))[:n] for g in got)

  def copy(self, source: int, slot: int) -> None:
    """Row `slot` of the cache becomes a copy of row `source`."""
    self.cache = self._copy(self.cache, *self.engine._host(np.int32(source), np.int32(slot)))

  def step(self, params, state: dict[str, np.ndarray], eos_ids: list[int],
           sampling: dict[str, np.ndarray], top: int) -> tuple[dict[str, np.ndarray], dict]:
    """Up to `chunk` steps of every busy slot (not `done`) from the host `state` ([slots]
    arrays: token, position, count, max_new, done, row); (the state after, {tokens, logprobs
    [slots, chunk] (-1 / 0 where a slot made none), top_ids, top_logprobs [slots, chunk, top]}).
    The busy slots' rows go through the program padded to a power of two (`step_rows`), so a
    call costs what its busy slots need, not what all the slots would. `launch` then `collect`."""
    busy, new_state, out = self.collect(self.launch(params, state, eos_ids, sampling, top))
    after = {k: v.copy() for k, v in state.items()}
    for k, v in new_state.items():
      after[k][busy] = v
    whole = {}
    for k, v in out.items():   # every slot's rows: a slot not in the call made no token (-1, 0)
      whole[k] = np.full((self.slots, *v.shape[1:]), -1 if k == "tokens" else 0, v.dtype)
      whole[k][busy] = v
    return after, whole

  def launch(self, params, state: dict[str, np.ndarray], eos_ids: list[int],
             sampling: dict[str, np.ndarray], top: int) -> Call:
    """`step`'s decoding call dispatched, not waited for: its results stay on the device (their
    copies to the host started) until `collect`; `follow` dispatches the next one after it."""
    params = self.engine.run_params(params)
    eos_E = np.full(MAX_EOS_IDS, -1, np.int32)
    eos_E[:len(eos_ids)] = eos_ids[:MAX_EOS_IDS]
    busy = np.flatnonzero(~state["done"])
    slots_B = self.step_rows(busy)
    at = np.minimum(slots_B, self.slots - 1)
    sub = {k: v[at] for k, v in state.items()}
    sub["done"] = sub["done"] | (slots_B >= self.slots)     # padding rows make nothing
    sub, inputs = self.engine._host(sub, (eos_E, {k: v[at] for k, v in sampling.items()},
                                          slots_B))
    return self._dispatch(params, Call(busy, len(slots_B), inputs, sub, {},
                                       int(state["position"][busy].max(initial=0)) + self.chunk,
                                       bool((sampling["temperature"][busy] > 0).any()), top))

  def follow(self, params, call: Call) -> Call:
    """The decoding call after `call` (in flight or not) over the same rows, dispatched from its
    state on the device (nothing read back): a row that finished in `call` stays done; its cache
    window holds `chunk` more positions per call followed."""
    return self._dispatch(self.engine.run_params(params),
                          Call(call.busy, call.rows, call.inputs, call.state, {},
                               call.reach + self.chunk, call.sampled, call.top))

  def _dispatch(self, params, call: Call) -> Call:
    self.cache, call.state, call.out = self._step(
        params, self.cache, call.state, *call.inputs, sampled=call.sampled, top=call.top,
        length=self.window(call.reach), early=self.interrupt is not None)
    for x in (*call.state.values(), *call.out.values()):
      x.copy_to_host_async()          # read back as soon as it ends: no round trip in `collect`
    return call

  def collect(self, call: Call) -> tuple[np.ndarray, dict[str, np.ndarray], dict]:
    """Waits for `call`; (its busy slots [n], their state after it {token, position, count,
    max_new, done, row: [n]}, their outputs {tokens, logprobs [n, chunk], top_ids,
    top_logprobs [n, chunk, top]})."""
    n = len(call.busy)
    at = call.busy if call.rows == self.slots else np.arange(n)
    return (call.busy, {k: fetch(v)[at] for k, v in call.state.items()},
            {k: fetch(v)[at] for k, v in call.out.items()})

  def warm(self, params) -> int:
    """Compiles the decoding call's program for every row bucket and cache window (greedy,
    without top log-probabilities; early ends as `interrupt` is set now: call it after the
    scheduler is built) by a call whose rows are all done (it changes nothing); the programs
    compiled."""
    params = self.engine.run_params(params)
    before = self.compiled_programs()
    eos_E = np.full(MAX_EOS_IDS, -1, np.int32)
    e = self.engine
    rows = sorted({len(self.step_rows(np.arange(n))) for n in range(1, self.slots + 1)})
    for B in rows:
      slots_B = self.step_rows(np.arange(B))
      state = {"token": np.zeros(B, np.int32), "position": np.zeros(B, np.int32),
               "count": np.zeros(B, np.int32), "max_new": np.ones(B, np.int32),
               "done": np.ones(B, bool), "row": np.zeros(B, np.int32)}
      for length in self.lengths:
        self.cache, *_ = self._step(params, self.cache,
                                    *e._host(state, eos_E, row_values([], B), slots_B),
                                    sampled=False, top=0, length=length,
                                    early=self.interrupt is not None)
    jax.block_until_ready(self.cache)
    return self.compiled_programs() - before

  def step_rows(self, busy: np.ndarray) -> np.ndarray:
    """The cache rows a decoding call runs for the busy slots `busy`: them, padded to a power of
    two (at least `min_rows`) with rows `slots` (nothing: done, dropped), or every slot in order
    once that power of two reaches the slots (so the row buckets are 1, 2, 4, ... below `slots`,
    then `slots`; with `min_rows` m: m rounded up to a power of two, 2m, ..., `slots`)."""
    B = bucket(max(len(busy), self.min_rows, 1))
    if B >= self.slots:
      return np.arange(self.slots, dtype=np.int32)
    out = np.full(B, self.slots, np.int32)
    out[:len(busy)] = busy
    return out
