"""Speculative greedy decoding with the model's own multi-token-prediction head as the drafter
(`speculative_tokens=k`; the MTP block: MaxText/layers/mtp.py).

Each round, per row, with the token t fed next at position p and k drafted tokens d_1..d_k:
  verify    one forward of the main model over [t, d_1, .., d_k] at positions p..p+k (the
            family's `extend`, the new tokens continuing the cache) → greedy g_0..g_k;
  accept    n = the longest prefix with d_{i+1} = g_i; the round emits g_0..g_n (n accepted
            drafts and the model's own next token), cut at an eos id or max_new_tokens;
  roll back the cache holds positions <= p+n, from the verification alone (`keeps_verified`):
            a group that rolls back by position (full-attention K/V, `rolls_back_by_position`)
            keeps the verified cache, the rejected positions rewritten before any query reads
            them; a recurrent state (Qwen3-Next's linear layers) keeps, during the verification,
            what each token adds to it instead of advancing (`cache.verifying`), and is advanced
            by the n+1 accepted tokens after it (`cache.keep_verified`: the conv window ending
            at p+n and the delta rule's state after it, the recurrence unrolled from the writes);
            a family with any other group (a sliding-window ring) drops the verification's cache
            and runs the accepted tokens again from the cache before it (a second forward);
  draft     the MTP layer 0 runs over the verified positions p..p+n (the main model's hidden
            states there with the tokens one ahead, g_0..g_n: its cache kept complete for the
            accepted positions) and its output at p+n drafts d'_1 for p+n+2; d'_i (i >= 2) comes
            from MTP layer (i-1) mod depths at position p+n+i-1 on d'_{i-1} and the previous
            draft's MTP hidden state (vLLM's recursion: a one-layer MTP head drafts any k).
Every emitted token is the main model's greedy choice given only accepted (so true) tokens, so the
output is plain greedy decoding's (tests/test_speculative.py). `rounds` rounds run per call inside
a `while_loop`; the host checks stop strings between calls, as the engine does. The counts of
drafted and accepted tokens (`stats`) give the acceptance rate.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from MaxText.decoding import cache as cache_lib
from MaxText.decoding.requests import MIN_PROMPT_BUCKET, Completion, bucket, fetch
from MaxText.layers.mtp import shifted
from MaxText.sharding.rules import use_rules


def rolls_back_by_position(mcfg) -> bool:
  """Whether every cache group of the family undoes rejected tokens by writing over them."""
  return all(getattr(g.kind, "rolls_back_by_position", False)
             for g in cache_lib.groups(mcfg).values())


def keeps_verified(mcfg) -> bool:
  """Whether the verification's cache can be kept for every group of the family: it rolls back by
  position, or its kind keeps what the verified tokens add and advances by the accepted ones
  (`verifying` / `keep_verified`: Qwen3-Next's linear layers). Otherwise the accepted tokens run
  again from the cache before the verification."""
  return all(getattr(g.kind, "rolls_back_by_position", False) or hasattr(g.kind, "keep_verified")
             for g in cache_lib.groups(mcfg).values())


class Speculative:
  """The speculative programs of an `Engine` (module docstring); `k` drafted tokens per round."""

  def __init__(self, engine: Any, k: int, rounds: int = 8):
    """`engine`: the decoding Engine these programs belong to (its model, mesh, rules, cache
    dtype and helpers)."""
    self.engine, self.k, self.rounds = engine, k, rounds
    self.depths = engine.mcfg.mtp_num_layers
    self.keeps_verified = keeps_verified(engine.mcfg)
    self._prefill = jax.jit(engine._counted(self._prefill_fn), static_argnames=("max_len",))
    self._decode = jax.jit(engine._counted(self._decode_fn), donate_argnums=(1,))
    self.stats = {"drafted": 0, "accepted": 0}

  # ---- compiled programs -------------------------------------------------------------------------
  def _drafts(self, model, cache, m_BD, q_B, active_B):
    """k drafts from the MTP hidden state `m_BD` at position `q_B` (whose token one ahead is
    known): d_1 from it, then each from MTP layer (i-1) mod depths one position further."""
    greedy = lambda h: jnp.argmax(model.logits(h[:, None])[:, 0], axis=-1).astype(jnp.int32)
    drafts = [greedy(m_BD)]
    for i in range(1, self.k):
      m_B1D, cache = model.mtp_extend(drafts[-1][:, None], m_BD[:, None], (q_B + i)[:, None],
                                      active_B[:, None], cache, prefill=False,
                                      depth=i % self.depths)
      m_BD = m_B1D[:, 0]
      drafts.append(greedy(m_BD))
    return jnp.stack(drafts, axis=1), cache

  def _prefill_fn(self, params, tokens_BS, lengths_B, *, max_len):
    e = self.engine
    B, S = tokens_BS.shape
    specs = cache_lib.specs(e.mcfg, B, max_len, e.cache_dtype)
    with use_rules(e.mesh, e.rules):
      model = e._model(params)
      cache = cache_lib.constrain_cache(cache_lib.empty(specs), specs, e.mesh, e.rules)
      positions_BS, valid_BS = e._prompt_positions(lengths_B, S)
      x_BSD, cache = model.extend(tokens_BS, positions_BS, valid_BS, cache, prefill=True)
      last_B = lengths_B - 1
      take = lambda a: jnp.take_along_axis(a, last_B[:, None, None], axis=1)[:, 0]
      logp_BV = jax.nn.log_softmax(model.logits(take(x_BSD)[:, None])[:, 0], axis=-1)
      first_B = jnp.argmax(logp_BV, axis=-1).astype(jnp.int32)
      first_lp_B = jnp.take_along_axis(logp_BV, first_B[:, None], axis=-1)[:, 0]
      ahead_BS = jnp.where(positions_BS == last_B[:, None], first_B[:, None],
                           shifted(tokens_BS, 1))
      m_BSD, cache = model.mtp_extend(ahead_BS, x_BSD, positions_BS, valid_BS, cache,
                                      prefill=True, depth=0)
      drafts_BK, cache = self._drafts(model, cache, take(m_BSD), last_B,
                                      jnp.ones((B,), bool))
      cache = cache_lib.constrain_cache(cache, specs, e.mesh, e.rules)
    return cache, *e._replicated(first_B, first_lp_B, drafts_BK)

  def _decode_fn(self, params, cache, state, eos_E, max_new):
    """Up to `rounds` rounds for all rows (module docstring). state: the token each row feeds
    next (`token`) at `position`, its drafts, tokens emitted (`count`), `done`, and the row's
    drafted / accepted counts."""
    e, k = self.engine, self.k
    B, R = state["token"].shape[0], self.rounds
    specs = cache_lib.specs(e.mcfg, 1, 1, e.cache_dtype)
    idx_K1 = jnp.arange(k + 1)
    with use_rules(e.mesh, e.rules):
      model = e._model(params)

      def one_round(carry):
        r, cache, st, out_tokens, out_logprobs = carry
        active_B = ~st["done"]
        tokens_BK1 = jnp.concatenate([st["token"][:, None], st["draft"]], axis=1)
        positions_BK1 = st["position"][:, None] + idx_K1[None]
        valid_BK1 = jnp.broadcast_to(active_B[:, None], tokens_BK1.shape)
        x_BK1D, verified = model.extend(
            tokens_BK1, positions_BK1, valid_BK1,
            cache_lib.verifying(e.mcfg, cache, k + 1) if self.keeps_verified else cache,
            prefill=False)
        logp_BK1V = jax.nn.log_softmax(model.logits(x_BK1D), axis=-1)
        g_BK1 = jnp.argmax(logp_BK1V, axis=-1).astype(jnp.int32)
        lp_BK1 = jnp.take_along_axis(logp_BK1V, g_BK1[..., None], axis=-1)[..., 0]
        n_B = jnp.sum(jnp.cumprod(st["draft"] == g_BK1[:, :k], axis=1), axis=1)
        accepted_BK1 = valid_BK1 & (idx_K1[None] <= n_B[:, None])
        # emitted: the accepted prefix, within max_new_tokens, up to and with the first eos
        emit_BK1 = accepted_BK1 & (st["count"][:, None] + idx_K1[None] < max_new)
        eos_BK1 = jnp.any(g_BK1[..., None] == eos_E, axis=-1) & emit_BK1
        emit_BK1 &= (jnp.cumsum(eos_BK1, axis=1) - eos_BK1) == 0
        emitted_B = jnp.sum(emit_BK1, axis=1)
        count_B = st["count"] + emitted_B
        finished_B = jnp.any(eos_BK1 & emit_BK1, axis=1) | (count_B >= max_new)
        if self.keeps_verified:
          cache = cache_lib.keep_verified(e.mcfg, verified, jnp.sum(accepted_BK1, axis=1))
        else:   # run the accepted tokens again from the cache before the verification
          x_BK1D, cache = model.extend(tokens_BK1, positions_BK1, accepted_BK1, cache,
                                       prefill=False)
        m_BK1D, cache = model.mtp_extend(g_BK1, x_BK1D, positions_BK1, accepted_BK1, cache,
                                         prefill=False, depth=0)
        m_BD = jnp.take_along_axis(m_BK1D, n_B[:, None, None], axis=1)[:, 0]
        drafts_BK, cache = self._drafts(model, cache, m_BD, st["position"] + n_B, active_B)
        at = r * (k + 1)
        out_tokens = jax.lax.dynamic_update_slice(
            out_tokens, jnp.where(emit_BK1, g_BK1, -1), (0, at))
        out_logprobs = jax.lax.dynamic_update_slice(
            out_logprobs, jnp.where(emit_BK1, lp_BK1, 0.0), (0, at))
        next_B = jnp.take_along_axis(g_BK1, n_B[:, None], axis=1)[:, 0]
        st = {"token": jnp.where(active_B, next_B, st["token"]),
              "position": st["position"] + jnp.where(active_B, n_B + 1, 0),
              "draft": jnp.where(active_B[:, None], drafts_BK, st["draft"]),
              "count": count_B, "done": st["done"] | (active_B & finished_B),
              "drafted": st["drafted"] + jnp.where(active_B, k, 0),
              "accepted": st["accepted"] + jnp.where(active_B, n_B, 0)}
        return r + 1, cache, st, out_tokens, out_logprobs

      init = (jnp.int32(0), cache, state, jnp.full((B, R * (k + 1)), -1, jnp.int32),
              jnp.zeros((B, R * (k + 1)), jnp.float32))
      _, cache, state, out_tokens, out_logprobs = jax.lax.while_loop(
          lambda c: (c[0] < R) & ~jnp.all(c[2]["done"]), one_round, init)
      cache = cache_lib.constrain_cache(cache, specs, e.mesh, e.rules)
    return cache, *e._replicated(state, out_tokens, out_logprobs)

  # ---- a batch of prompts ------------------------------------------------------------------------
  def generate_batch(self, params, prompts, max_len, max_new, eos_E, stop,
                     detokenize) -> list[Completion]:
    """The engine's `_generate_batch` for greedy decoding, speculatively (module docstring)."""
    e = self.engine
    n = len(prompts)
    B = bucket(n)
    S = bucket(max(len(p) for p in prompts), MIN_PROMPT_BUCKET, max_len)
    tokens_BS = np.zeros((B, S), np.int32)
    lengths_B = np.ones(B, np.int32)
    for b, p in enumerate(prompts):
      tokens_BS[b, :len(p)] = p
      lengths_B[b] = len(p)
    cache, first_B, first_lp_B, drafts_BK = self._prefill(
        params, *e._host(tokens_BS, lengths_B), max_len=max_len)
    first_B, first_lp_B, drafts_BK = fetch(first_B), fetch(first_lp_B), fetch(drafts_BK)
    results = [Completion(list(p), [int(first_B[b])], [float(first_lp_B[b])])
               for b, p in enumerate(prompts)]
    done_B = np.ones(B, bool)
    for b, c in enumerate(results):
      done_B[b] = e._finished(c, eos_E, max_new, stop, detokenize, checked=0)
    zeros = np.zeros(B, np.int32)
    state = {"token": first_B.astype(np.int32), "position": lengths_B.copy(),
             "draft": drafts_BK.astype(np.int32), "count": np.ones(B, np.int32),
             "done": done_B, "drafted": zeros, "accepted": zeros}
    while not done_B.all():
      checked = [len(c.output_ids) for c in results]
      cache, state, out_tokens, out_logprobs = self._decode(
          params, cache, *e._host(state, eos_E, np.int32(max_new)))
      state = e._collect(results, out_tokens, out_logprobs, state, checked, eos_E, max_new,
                         stop, detokenize)
      done_B = state["done"]
    self.stats["drafted"] += int(state["drafted"][:n].sum())
    self.stats["accepted"] += int(state["accepted"][:n].sum())
    return results

  def acceptance_rate(self) -> float:
    """Accepted drafts / drafted tokens so far (0 before any)."""
    return self.stats["accepted"] / max(self.stats["drafted"], 1)
