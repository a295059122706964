"""Qwen3-Next's Gated DeltaNet layer (its linear-attention layers), for training over packed rows
and one token at a time with an explicit state (decoding).

Conventions
  B batch, S sequence, D model width, Hk key heads, Hv value heads (G = Hv / Hk per key head),
  Dk / Dv key / value head width, W conv width, X = 2·Dk + G·Dv (one key head's q|k|v channels).
  Arrays are named by shape; parameters carry logical axis names (key and value heads: "heads").

Parameters, laid out per key head as the checkpoint groups them (so tensor parallelism splits
whole key heads and their value heads together):
  in_proj_qkvz [D, Hk, 2·Dk + 2·G·Dv]   per key head: q (Dk) | k (Dk) | v (G·Dv) | z (G·Dv)
  in_proj_ba   [D, Hk, 2·G]             per key head: b (G) | a (G)
  conv         [W, Hk, X]               depthwise causal conv over q|k|v, no bias
  A_log, dt_bias [Hv];  norm/scale [Dv];  out_proj [Hv, Dv, D]
Value head h belongs to key head h // G.

Forward: q|k|v → causal conv (restarting at every packed document) → SiLU; β = sigmoid(b),
g = −exp(A_log)·softplus(a + dt_bias) (fp32); q, k L2-normalised (q also × Dk^-1/2) and repeated
to the value heads; the gated delta rule (MaxText/layers/gated_delta.py: chunked for training, or
token by token with linear_recurrence=token); rms(o)·w·silu(z); out_proj.

Decoding: `init_state(batch)` → {"conv": the last W−1 inputs of q|k|v [B, W−1, Hk, X],
"delta": the delta-rule state [B, Hv, Dk, Dv] fp32}, both zero at a document's start;
`step(x_BD, state)` → (y_BD, next state). `extend` keeps that state in the decoding cache
(`LinearState`, one row per linear layer): a prefill runs the chunked rule over the prompts and
stores its final state and each prompt's last W−1 conv inputs; a decoding step is `step`; several
tokens that continue the state (a prompt's piece in chunked prefill) run the prefill's form — the
conv over the cached window, then the chunked rule from the cached state.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from MaxText.layers.causal_conv import causal_conv, causal_conv_step
from MaxText.layers.gated_delta import (chunked_gated_delta_rule, chunked_gated_delta_writes,
                                        document_starts, gated_delta_rule, gated_delta_step,
                                        l2_normalize, state_after)
from MaxText.layers.kv_cache import ArraySpec
from MaxText.layers.linear import DenseGeneral, LayerKw
from MaxText.layers.norms import GatedRMSNorm
from MaxText.models.model_config import ModelConfig
from MaxText.layers.context_parallel import context_size
from MaxText.layers.context_parallel_linear import (conv_over_chunks, gated_delta_over_chunks,
                                                    resets_over_chunks)
from MaxText.sharding.rules import constrain, current_context

ACT_BSHX = ("activation_batch", "activation_length", "activation_heads", None)
ACT_BSD = ("activation_batch", "activation_length", "activation_embed")


@dataclass(frozen=True)
class LinearState:
  """A Gated DeltaNet layer's decoding cache (a kind of MaxText/layers/kv_cache.py): the conv window
  [B, W−1, Hk, X] in the cache dtype and the delta-rule state [B, Hv, Dk, Dv] in fp32 whatever the
  cache dtype; heads split like the layer's (over tensor). Its size does not grow with the length."""
  key_heads: int
  value_heads: int
  key_dim: int
  value_dim: int
  conv_width: int

  def arrays(self, batch: int, max_len: int, dtype: Any) -> dict[str, ArraySpec]:
    G = self.value_heads // self.key_heads
    X = 2 * self.key_dim + G * self.value_dim
    return {"conv": ArraySpec((batch, self.conv_width - 1, self.key_heads, X), dtype,
                              ("activation_batch", None, "activation_heads", None)),
            "delta": ArraySpec((batch, self.value_heads, self.key_dim, self.value_dim),
                               jnp.float32, ("activation_batch", "activation_heads", None, None))}

  # ---- speculative decoding's roll-back (MaxText/decoding/speculative.py) ------------------------
  def verifying(self, group: dict, tokens: int) -> dict:
    """The stacked `group` (arrays [L, B, ...]) ready for a verification of `tokens` tokens: with
    room for what each layer's `extend` then keeps of them instead of advancing its state — the
    inputs of the conv (`verify_qkv` [L, B, S, Hk, X], cache dtype) and, in fp32, the delta rule's
    keys `verify_k` [L, B, S, Hv, Dk], writes `verify_write` [L, B, S, Hv, Dv] and log decays
    `verify_g` [L, B, S, Hv] — from which `keep_verified` makes the state after any prefix: per
    layer S·Hv·(Dk + Dv + 1) numbers a row, not the S states of Hv·Dk·Dv each."""
    L, B, _, Hk, X = group["conv"].shape
    Hv, Dk, Dv = self.value_heads, self.key_dim, self.value_dim
    zeros = lambda *shape, dtype=jnp.float32: jnp.zeros((L, B, tokens, *shape), dtype)
    return {**group, "verify_qkv": zeros(Hk, X, dtype=group["conv"].dtype),
            "verify_k": zeros(Hv, Dk), "verify_write": zeros(Hv, Dv), "verify_g": zeros(Hv)}

  def keep_verified(self, group: dict, kept_B) -> dict:
    """A `verifying` group after the verification, as if only each row's first `kept_B` tokens
    (0..S) had run: the conv window the last W−1 inputs ending at the last kept token, the delta
    rule's state `state_after` them (the cache before the verification advanced by the kept
    tokens; no second forward). Returns the group in its usual arrays."""
    conv = group["conv"]
    Wm1 = conv.shape[2]
    inputs = jnp.concatenate([conv, group["verify_qkv"]], axis=2)       # [L, B, W−1+S, Hk, X]
    at_BW = kept_B[:, None] + jnp.arange(Wm1)
    window = jnp.take_along_axis(inputs, at_BW[None, :, :, None, None], axis=2)
    delta = jax.vmap(state_after, in_axes=(0, 0, 0, 0, None))(
        group["delta"], group["verify_k"], group["verify_write"], group["verify_g"], kept_B)
    return {"conv": window, "delta": delta.astype(group["delta"].dtype)}


def linear_state(cfg: ModelConfig) -> LinearState:
  return LinearState(cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                     cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                     cfg.linear_conv_kernel_dim)


class GatedDeltaNet(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    D, Hk, Hv = cfg.emb_dim, cfg.linear_num_key_heads, cfg.linear_num_value_heads
    Dk, Dv, W = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
    G = Hv // Hk
    self.dims = (Hk, Hv, Dk, Dv, G)
    self.dtype = cfg.compute_dtype
    kw = LayerKw(rngs=rngs, dtype=cfg.compute_dtype, param_dtype=cfg.param_dtype)
    self.in_proj_qkvz = DenseGeneral((D,), (Hk, 2 * Dk + 2 * G * Dv), ("embed", "heads", None),
                                     **kw)
    self.in_proj_ba = DenseGeneral((D,), (Hk, 2 * G), ("embed", "heads", None), **kw)
    conv = W ** -0.5 * jax.random.normal(rngs.params(), (W, Hk, 2 * Dk + G * Dv), jnp.float32)
    self.conv = nnx.Param(conv.astype(cfg.param_dtype), logical_axes=(None, "heads", None))
    # the Mamba / FLA init: A uniform in [1, 16], time steps dt log-uniform in [1e-3, 0.1] with
    # dt_bias = softplus^-1(dt), so that the decays exp(-A dt) start near 1 (long memory). (HF's
    # dt_bias = 1 starts with decays near exp(-10): each token nearly resets the state, the
    # outputs o are tiny and their RMSNorm amplifies fp32 rounding ~1e3x in the gradients.)
    A = jax.random.uniform(rngs.params(), (Hv,), jnp.float32, 1.0, 16.0)
    self.A_log = nnx.Param(jnp.log(A).astype(cfg.param_dtype), logical_axes=("heads",))
    dt = jnp.exp(jax.random.uniform(rngs.params(), (Hv,), jnp.float32, jnp.log(1e-3),
                                    jnp.log(0.1)))
    self.dt_bias = nnx.Param((dt + jnp.log(-jnp.expm1(-dt))).astype(cfg.param_dtype),
                             logical_axes=("heads",))
    self.norm = GatedRMSNorm(Dv, eps=cfg.norm_epsilon, **kw)
    self.out_proj = DenseGeneral((Hv, Dv), (D,), ("heads", None, "embed"), **kw)
    self.chunk_size = cfg.linear_chunk_size
    self.chunked = cfg.linear_recurrence == "chunked"

  # ---- the pieces both forms share (any leading dims `...`) --------------------------------------
  def _project(self, x_D):
    """x → (q|k|v [..., Hk, X], z [..., Hv, Dv], b and a [..., Hv])."""
    Hk, Hv, Dk, Dv, G = self.dims
    qkvz = self.in_proj_qkvz(x_D)
    ba = self.in_proj_ba(x_D)
    lead = x_D.shape[:-1]
    qkv, z = qkvz[..., :2 * Dk + G * Dv], qkvz[..., 2 * Dk + G * Dv:].reshape(*lead, Hv, Dv)
    return qkv, z, ba[..., :G].reshape(*lead, Hv), ba[..., G:].reshape(*lead, Hv)

  def _rule_inputs(self, mixed, b, a):
    """Conv output and b, a → (q, k [..., Hv, Dk] normalised and repeated, v [..., Hv, Dv], g, β),
    the gates in fp32."""
    Hk, Hv, Dk, Dv, G = self.dims
    lead = mixed.shape[:-2]
    mixed = jax.nn.silu(mixed).astype(self.dtype)
    q = l2_normalize(mixed[..., :Dk]) * Dk ** -0.5
    k = l2_normalize(mixed[..., Dk:2 * Dk])
    v = mixed[..., 2 * Dk:].reshape(*lead, Hv, Dv)
    q, k = jnp.repeat(q, G, axis=-2), jnp.repeat(k, G, axis=-2)
    beta = jax.nn.sigmoid(b)
    g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
        a.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
    return q, k, v, g, beta

  def _output(self, o, z):
    return self.out_proj(self.norm(o.astype(self.dtype), z))

  # ---- training: packed rows ---------------------------------------------------------------------
  def __call__(self, x_BSD, segment_ids_BS):
    qkv, z, b, a = self._project(x_BSD)
    qkv = constrain(qkv, ACT_BSHX)
    ctx = current_context()
    n = context_size(ctx, *segment_ids_BS.shape)
    if n > 1:   # the sequence split over the context axis: the state handed along it
      assert ctx is not None
      mixed = conv_over_chunks(qkv, self.conv[...], segment_ids_BS, n)
      q, k, v, g, beta = self._rule_inputs(mixed, b, a)
      o = gated_delta_over_chunks(q, k, v, g, beta, resets_over_chunks(segment_ids_BS, n),
                                  ctx=ctx, chunk_size=self.chunk_size)
      return constrain(self._output(constrain(o, ACT_BSHX), z), ACT_BSD)
    mixed = causal_conv(qkv, self.conv[...], document_starts(segment_ids_BS))
    q, k, v, g, beta = self._rule_inputs(mixed, b, a)
    o = gated_delta_rule(q, k, v, g, beta, segment_ids_BS, chunk_size=self.chunk_size,
                         chunked=self.chunked)
    return constrain(self._output(constrain(o, ACT_BSHX), z), ACT_BSD)

  # ---- decoding: one token -----------------------------------------------------------------------
  def init_state(self, batch: int) -> dict:
    Hk, Hv, Dk, Dv, G = self.dims
    W = self.conv.get_value().shape[0]
    return {"conv": jnp.zeros((batch, W - 1, Hk, 2 * Dk + G * Dv), self.dtype),
            "delta": jnp.zeros((batch, Hv, Dk, Dv), jnp.float32)}

  def extend(self, x_BSD, valid_BS, prefill: bool, group: dict | None, index):
    """Decoding (`valid_BS`: the real tokens of right-padded rows): a prefill runs prompts from a
    zero state (padding neither writes nor decays the state: β = 0, g = 0) and stores in row
    `index` of the cache `group` (None: no cache) the final delta-rule state and each prompt's last
    W−1 conv inputs; otherwise the new tokens continue the cached state: one token through
    `step`, several (a prompt's piece, speculative decoding's drafts: MaxText/decoding/
    speculative.py) through `_continue`; a token that is not valid leaves the state as it was.
    A verification (`group` made by `LinearState.verifying`) leaves the state as it was and keeps
    in the group what `LinearState.keep_verified` needs to advance it by any prefix of the tokens.
    Returns (output, group)."""
    if not prefill:
      if group is None:
        raise ValueError("a decoding step after the prefill continues the cache: group is None")
      state = {name: group[name][index] for name in ("conv", "delta")}
      if "verify_write" in group:
        y_BSD, _, pieces = self._continue(x_BSD, valid_BS, state, pieces=True)
        assert pieces is not None
        return y_BSD, {**group, **{f"verify_{name}": group[f"verify_{name}"].at[index].set(
            a.astype(group[f"verify_{name}"].dtype)) for name, a in pieces.items()}}

      def one(state, xs):
        x_BD, valid_B = xs
        y_BD, new = self.step(x_BD, state)
        keep = lambda a: valid_B.reshape(-1, *(1,) * (a.ndim - 1))
        return {name: jnp.where(keep(new[name]), new[name], state[name]).astype(state[name].dtype)
                for name in state}, y_BD

      if x_BSD.shape[1] == 1:
        state, y_BD = one(state, (x_BSD[:, 0], valid_BS[:, 0]))
        y_BSD = y_BD[:, None]
      else:
        y_BSD, state, _ = self._continue(x_BSD, valid_BS, state)
      group = {name: group[name].at[index].set(state[name]) for name in state}
      return y_BSD, group
    qkv, z, b, a = self._project(x_BSD)
    qkv = constrain(qkv, ACT_BSHX)
    mixed = causal_conv(qkv, self.conv[...], document_starts(valid_BS.astype(jnp.int32)))
    q, k, v, g, beta = self._rule_inputs(mixed, b, a)
    real_BS1 = valid_BS[..., None]
    o, delta = chunked_gated_delta_rule(q, k, v, jnp.where(real_BS1, g, 0.0),
                                        jnp.where(real_BS1, beta, 0.0),
                                        jnp.zeros_like(valid_BS).at[:, 0].set(True),
                                        chunk_size=self.chunk_size)
    y = constrain(self._output(constrain(o, ACT_BSHX), z), ACT_BSD)
    if group is None:
      return y, None
    W = self.conv.get_value().shape[0]
    lengths_B = jnp.sum(valid_BS, axis=1)
    at_BW = lengths_B[:, None] - (W - 1) + jnp.arange(W - 1)          # the last W−1 inputs
    window = jnp.take_along_axis(qkv, jnp.clip(at_BW, 0)[:, :, None, None], axis=1)
    window = jnp.where((at_BW >= 0)[:, :, None, None], window, 0)     # zeros before the start
    group = {"conv": group["conv"].at[index].set(window.astype(group["conv"].dtype)),
             "delta": group["delta"].at[index].set(delta)}
    return y, group

  def _continue(self, x_BSD, valid_BS, state: dict,
                pieces: bool = False) -> tuple[jax.Array, dict, dict | None]:
    """Several tokens (right-padded rows: a piece of a prompt, speculative decoding's drafts)
    continuing `state`, in the prefill's form: the conv over the cached window followed by the
    new inputs, the chunked rule from the cached delta-rule state (padding neither writes nor
    decays it). Returns (output, the state after each row's valid tokens, and with `pieces` the
    conv inputs `qkv` and the rule's keys `k`, writes `write` and log decays `g` per token — what
    `LinearState.keep_verified` advances the state by — else None)."""
    window = state["conv"]
    Wm1 = window.shape[1]
    qkv, z, b, a = self._project(x_BSD)
    qkv = constrain(qkv, ACT_BSHX)
    inputs = jnp.concatenate([window.astype(qkv.dtype), qkv], axis=1)   # [B, W−1+S, Hk, X]
    starts = jnp.zeros(inputs.shape[:2], jnp.bool_).at[:, 0].set(True)
    mixed = causal_conv(inputs, self.conv[...], starts)[:, Wm1:]
    q, k, v, g, beta = self._rule_inputs(mixed, b, a)
    real_BS1 = valid_BS[..., None]
    g = jnp.where(real_BS1, g, 0.0)
    rule = chunked_gated_delta_writes if pieces else chunked_gated_delta_rule
    o, delta, *writes = rule(q, k, v, g, jnp.where(real_BS1, beta, 0.0), jnp.zeros_like(valid_BS),
                             chunk_size=min(self.chunk_size, x_BSD.shape[1]),
                             initial_state_BHKV=state["delta"])
    y = constrain(self._output(constrain(o, ACT_BSHX), z), ACT_BSD)
    at_BW = jnp.sum(valid_BS, axis=1)[:, None] + jnp.arange(Wm1)     # the last W−1 inputs
    window = jnp.take_along_axis(inputs, at_BW[:, :, None, None], axis=1)
    return y, {"conv": window.astype(state["conv"].dtype),
               "delta": delta.astype(state["delta"].dtype)}, (
                   {"qkv": qkv, "k": k, "write": writes[0], "g": g} if pieces else None)

  def step(self, x_BD, state: dict) -> tuple[jax.Array, dict]:
    qkv, z, b, a = self._project(x_BD)
    mixed, window = causal_conv_step(state["conv"], qkv, self.conv[...])
    q, k, v, g, beta = self._rule_inputs(mixed, b, a)
    o, delta = gated_delta_step(state["delta"], q, k, v, g, beta)
    return self._output(o, z), {"conv": window, "delta": delta}
