"""The gated delta rule (Gated DeltaNet, Yang et al. 2024): linear attention whose state is a
fast-weight matrix updated by the delta rule with a per-token decay, in three equal forms:

  chunked_gated_delta_rule     training: chunks of C tokens (intra-chunk work batched, one small
                               scan over chunks), cost linear in the sequence
                               (`chunked_gated_delta_writes`: also what each token adds, from
                               which `state_after` gives the state after any prefix)
  recurrent_gated_delta_rule   the reference: one token at a time (a scan over the sequence)
  gated_delta_step             one token with an explicit state (decoding)

Conventions
  B batch, S sequence, H heads (value heads; q/k already repeated to them), K key head dim, V value
  head dim, C chunk length, N chunks. State [B, H, K, V]. Everything is computed in fp32.

Per token t of a document (state S from 0 at the document's first token):
  S ← exp(g_t) · S                       g_t ≤ 0: the log decay
  S ← S + β_t · k_t (v_t − Sᵀk_t)ᵀ       the delta rule (β_t in (0, 1): the write strength)
  o_t = Sᵀ q_t
q and k are expected L2-normalised (q also scaled by K^-1/2), as Gated DeltaNet layers do.

Packed documents: `reset_BS` marks each document's first token (`document_starts` from segment
ids); the state restarts there, in every form — a packed row equals each document run alone.

Chunked form (the WY/UT form of DeltaNet, with the decay): inside a chunk, with γ_ij =
exp(Σ_{j<s≤i} g_s) for i ≥ j of one document (0 across a document start), the β-scaled updates
solve the unit lower-triangular system (I + L) X = [β v | β k γ_i0] with L_ij = β_i k_i·k_j γ_ij
(i > j), giving the new values u and the state readers w; then per chunk, from the incoming state S:
  v' = u − w S,    o = (q γ_i0) S + (q kᵀ ⊙ γ) v',    S ← γ_C0 S + Σ_j (k_j γ_Cj) v'_jᵀ
where γ_i0 is 0 for tokens past a document start inside the chunk. Every decay is the exponential
of an in-chunk sum of log decays — Σ_{j<s≤i} g_s summed directly (a segment sum), not as a
difference of cumulative sums, which strong decays make large enough to lose precision — masked
to i ≥ j of one document BEFORE the exp, so no exp overflows and gradients stay finite; the triangular system is solved in fp32 through its
inverse (I + L)^-1, by forward substitution (`unit_lower_inverse`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from MaxText.sharding.rules import constrain, current_context, logical_to_spec

F32 = jnp.float32


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  """x / sqrt(sum(x^2) + eps) over the last axis, in fp32 (as the FLA kernels and transformers)."""
  x = x.astype(F32)
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def document_starts(segment_ids_BS: jax.Array) -> jax.Array:
  """True at the first token of a row and wherever the segment id changes (packed documents;
  padding, id 0, is a document of its own)."""
  changed = segment_ids_BS[:, 1:] != segment_ids_BS[:, :-1]
  return jnp.concatenate([jnp.ones_like(changed[:, :1]), changed], axis=1)


def gated_delta_step(state_BHKV, q_BHK, k_BHK, v_BHV, g_BH, beta_BH):
  """One token: (o [B, H, V], the new state [B, H, K, V]). The caller zeroes the state at a
  document's first token."""
  state = state_BHKV.astype(F32) * jnp.exp(g_BH.astype(F32))[..., None, None]
  k, q = k_BHK.astype(F32), q_BHK.astype(F32)
  predicted_BHV = jnp.einsum("bhkv,bhk->bhv", state, k)
  delta_BHV = (v_BHV.astype(F32) - predicted_BHV) * beta_BH.astype(F32)[..., None]
  state = state + k[..., :, None] * delta_BHV[..., None, :]
  return jnp.einsum("bhkv,bhk->bhv", state, q), state


def _zero_state(q_BSHK, v_BSHV):
  B, _, H, K = q_BSHK.shape
  return jnp.zeros((B, H, K, v_BSHV.shape[-1]), F32)


def recurrent_gated_delta_rule(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, reset_BS,
                               initial_state_BHKV=None):
  """The token-by-token form: (o [B, S, H, V] fp32, final state [B, H, K, V])."""
  state = _zero_state(q_BSHK, v_BSHV) if initial_state_BHKV is None else initial_state_BHKV

  def body(state, xs):
    q, k, v, g, beta, reset = xs
    state = jnp.where(reset[:, None, None, None], 0.0, state)
    o, state = gated_delta_step(state, q, k, v, g, beta)
    return state, o

  time_major = lambda a: jnp.moveaxis(a, 1, 0)
  xs = tuple(map(time_major, (q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, reset_BS)))
  state, o_SBHV = jax.lax.scan(body, state.astype(F32), xs)
  return jnp.moveaxis(o_SBHV, 0, 1), state


@jax.custom_vjp
def unit_lower_inverse(L_CC: jax.Array) -> jax.Array:
  """(I + L)^-1 of strictly lower-triangular L [..., C, C] (fp32) by forward substitution: row i
  of the inverse is e_i − Σ_{j<i} L_ij · (row j). XLA ops only — not LAPACK's trsm, which the CPU
  backend calls from every fake device's thread at once (scipy's OpenBLAS then hangs the step).
  The gradient is the inverse's own: dL = −Aᵀ dA Aᵀ (strictly lower part), no saved loop state."""
  C = L_CC.shape[-1]
  eye = jnp.eye(C, dtype=L_CC.dtype)

  def row(i, inv):   # rows < i are final, rows ≥ i still the identity's (L_ij = 0 for j ≥ i)
    return inv.at[..., i, :].set(eye[i] - jnp.einsum("...j,...jc->...c", L_CC[..., i, :], inv))

  return jax.lax.fori_loop(0, C, row, jnp.broadcast_to(eye, L_CC.shape))


def _inverse_fwd(L_CC):
  inv = unit_lower_inverse(L_CC)
  return inv, inv


def _inverse_bwd(inv, d_inv):
  C = inv.shape[-1]
  dL = -jnp.einsum("...ji,...jk,...lk->...il", inv, d_inv, inv)
  return (jnp.where(jnp.tril(jnp.ones((C, C), jnp.bool_), -1), dL, 0.0),)


unit_lower_inverse.defvjp(_inverse_fwd, _inverse_bwd)


def chunked_gated_delta_rule(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, reset_BS, *,
                             chunk_size: int = 64, initial_state_BHKV=None):
  """The chunked form (see the module docstring): (o [B, S, H, V] fp32, final state [B, H, K, V]).
  A sequence that is not a multiple of `chunk_size` is padded with tokens that leave the state
  unchanged (k = v = β = 0, g = 0)."""
  o, state, _ = _chunked(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, reset_BS, chunk_size,
                         initial_state_BHKV, writes=False)
  return o, state


def chunked_gated_delta_writes(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, reset_BS, *,
                               chunk_size: int = 64, initial_state_BHKV=None):
  """`chunked_gated_delta_rule` and each token's write v' [B, S, H, V] fp32 (the amount it adds to
  the state, what `state_after` folds in): (o, final state, writes)."""
  o, state, writes = _chunked(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, reset_BS, chunk_size,
                              initial_state_BHKV, writes=True)
  assert writes is not None
  return o, state, writes


def _chunked(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, reset_BS, chunk_size, initial_state_BHKV,
             writes: bool):
  B, S, H, K = q_BSHK.shape
  V = v_BSHV.shape[-1]
  C = chunk_size
  N = -(-S // C)
  pad = N * C - S

  def chunks(a, fill=0):   # [B, S, H, ...] → [B, H, N, C, ...] (fp32), padded at the end
    a = jnp.pad(a.astype(F32), [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2), constant_values=fill)
    a = jnp.moveaxis(a, 2, 1)
    return a.reshape(B, H, N, C, *a.shape[3:])

  q, k, v = chunks(q_BSHK), chunks(k_BSHK), chunks(v_BSHV)
  g, beta = chunks(g_BSH), chunks(beta_BSH)                           # [B, H, N, C]
  reset = jnp.pad(reset_BS, [(0, 0), (0, pad)])
  doc = jnp.cumsum(reset.astype(jnp.int32), axis=1).reshape(B, N, C)  # document index per token
  reset = reset.reshape(B, N, C)
  doc_before = doc[..., :1] - reset[..., :1]                           # of the previous chunk's end
  same_BNCC = doc[..., :, None] == doc[..., None, :]
  causal_CC = jnp.tril(jnp.ones((C, C), jnp.bool_))
  incl = (same_BNCC & causal_CC)[:, None]                              # i ≥ j, one document
  strict = (same_BNCC & jnp.tril(jnp.ones((C, C), jnp.bool_), -1))[:, None]
  carried = (doc == doc_before)[:, None]                               # reads the incoming state
  ends_doc = (doc == doc[..., -1:])[:, None]                           # reaches the outgoing state

  cum = jnp.cumsum(g, axis=-1)                                         # [B, H, N, C], ≤ 0
  # Σ_{j<s≤i} g_s summed directly, not as cum_i − cum_j: with strong decays (|g| ~ 10 a token)
  # the cumulative sums reach hundreds and their difference would lose ~|cum|·2^-24 to
  # cancellation, an error the output RMSNorm amplifies (Mamba-2's segment sum)
  seg = jnp.cumsum(jnp.where(jnp.tril(jnp.ones((C, C), jnp.bool_), -1), g[..., :, None], 0.0),
                   axis=-2)                                            # [B, H, N, C, C]
  gamma = jnp.exp(jnp.where(incl, seg, -jnp.inf))
  from_start = jnp.exp(jnp.where(carried, cum, -jnp.inf))              # γ_i0 (0 past a start)
  to_end = jnp.exp(jnp.where(ends_doc, seg[..., -1, :], -jnp.inf))     # γ_Cj
  chunk_decay = from_start[..., -1]                                    # γ_C0 [B, H, N]

  kk = jnp.einsum("bhnik,bhnjk->bhnij", k, k)
  lower = jnp.where(strict, beta[..., :, None] * kk * gamma, 0.0)
  rhs = jnp.concatenate([beta[..., None] * v, (beta * from_start)[..., None] * k], axis=-1)
  solved = jnp.einsum("bhnij,bhnjm->bhnim", unit_lower_inverse(lower), rhs)
  u, w = solved[..., :V], solved[..., V:]                              # [B,H,N,C,V], [B,H,N,C,K]
  attn = jnp.where(incl, jnp.einsum("bhnik,bhnjk->bhnij", q, k) * gamma, 0.0)
  q_in = q * from_start[..., None]
  k_out = k * to_end[..., None]

  def body(state, xs):
    u_c, w_c, attn_c, q_c, k_c, decay_c = xs
    v_new = u_c - jnp.einsum("bhck,bhkv->bhcv", w_c, state)
    o_c = jnp.einsum("bhck,bhkv->bhcv", q_c, state) + jnp.einsum("bhij,bhjv->bhiv", attn_c, v_new)
    state = decay_c[..., None, None] * state + jnp.einsum("bhck,bhcv->bhkv", k_c, v_new)
    return state, (o_c, v_new) if writes else o_c

  chunk_major = lambda a: jnp.moveaxis(a, 2, 0)
  state = _zero_state(q_BSHK, v_BSHV) if initial_state_BHKV is None else initial_state_BHKV
  state, out = jax.lax.scan(body, state.astype(F32),
                            tuple(map(chunk_major, (u, w, attn, q_in, k_out, chunk_decay))))
  # [N, B, H, C, V] → [B, S, H, V]
  token_major = lambda a: jnp.moveaxis(jnp.moveaxis(a, 0, 2).reshape(B, H, N * C, V)[:, :, :S],
                                       1, 2)
  if writes:
    return token_major(out[0]), state, token_major(out[1])
  return token_major(out), state, None


def state_after(state_BHKV, k_BSHK, writes_BSHV, g_BSH, kept_B):
  """The state after each row's first `kept_B` tokens (0..S) of a piece that continued `state_BHKV`
  (one document; speculative decoding's verified tokens: MaxText/decoding/speculative.py), from the
  piece's keys, writes v' (`chunked_gated_delta_writes`: the amount each
  token adds, v'_j = β_j (v_j − (exp(g_j) S_{j-1})ᵀ k_j)) and log decays, by the recurrence unrolled:
    S_m = exp(Σ_{s<m} g_s) S_0 + Σ_{j<m} exp(Σ_{j<s<m} g_s) k_j v'_jᵀ
  (the decays summed directly over the kept tokens, as the chunked form's segment sums). Exactly
  the token-by-token state S_m up to rounding, without the piece's states at every position."""
  S = k_BSHK.shape[1]
  kept_BS = jnp.arange(S)[None] < kept_B[:, None]
  g = jnp.where(kept_BS[..., None], g_BSH.astype(F32), 0.0)             # [B, S, H]
  later_SS = jnp.arange(S)[None, :] > jnp.arange(S)[:, None]              # [j, s]: s > j
  after_BSH = jnp.sum(jnp.where(later_SS[None, :, :, None], g[:, None], 0.0), axis=2)
  weight_BSH = jnp.where(kept_BS[..., None], jnp.exp(after_BSH), 0.0)     # exp(Σ_{j<s<m} g_s)
  decay_BH = jnp.exp(jnp.sum(g, axis=1))
  return (decay_BH[..., None, None] * state_BHKV.astype(F32)
          + jnp.einsum("bsh,bshk,bshv->bhkv", weight_BSH, k_BSHK.astype(F32),
                       writes_BSHV.astype(F32)))


def gated_delta_rule(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, segment_ids_BS, *,
                     chunk_size: int = 64, chunked: bool = True) -> jax.Array:
  """A training forward over packed rows: the state starts at zero and restarts at every document
  start. Under a mesh (`use_rules`) its inputs and output are constrained to batch over the
  `activation_batch` axes and heads over `activation_heads`, and XLA partitions it along those
  (every operation is per row and head: no communication); a sequence sharded over the context
  axis is refused (ValueError: the recurrence would need the state of the previous shard).
  Returns o [B, S, H, V] in fp32.

  (Not `shard_map`: on XLA:CPU a shard_map'd rule inside a scanned block of several repeats hangs
  the step at run time, jax 0.10.2; the partitioner gives the same per-shard program.)"""
  ctx = current_context()
  if ctx is not None:
    B, S, H, _ = q_BSHK.shape
    length = logical_to_spec(("activation_batch", "activation_length"), (B, S), ctx.rules,
                             ctx.mesh)[1]
    length = () if length is None else (length,) if isinstance(length, str) else length
    if any(ctx.mesh.shape[a] > 1 for a in length):
      raise ValueError("the gated delta rule does not support a sequence sharded over the context "
                       "axis (context parallelism)")
  x_axes = ("activation_batch", None, "activation_heads", None)
  gate_axes = ("activation_batch", None, "activation_heads")
  q, k, v = (constrain(a, x_axes) for a in (q_BSHK, k_BSHK, v_BSHV))
  g, beta = constrain(g_BSH, gate_axes), constrain(beta_BSH, gate_axes)
  reset = document_starts(segment_ids_BS)
  if chunked:
    o = chunked_gated_delta_rule(q, k, v, g, beta, reset, chunk_size=chunk_size)[0]
  else:
    o = recurrent_gated_delta_rule(q, k, v, g, beta, reset)[0]
  return constrain(o, x_axes)
