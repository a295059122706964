"""Gemma 4 text decoder (Hugging Face `gemma4_text`, the text part of `gemma4`).

Conventions
  dimension letters: B batch, S query sequence, T key sequence, D model width (emb_dim),
  H query heads, K kv heads, E head dim (per layer kind), F mlp hidden, V vocab, L layers,
  P per-layer-input width (PLE).
  Arrays are named by shape (`x_BSD`); parameters carry logical axis names, mapped to the mesh by
  the `logical_axis_rules` table.

Layer i (kind = sliding/full from `attention_pattern`, and whether it is a kv-shared tail layer):
  h = x + post_attn_norm(attn(attn_norm(x)))
  h = h + post_mlp_norm(mlp(mlp_norm(h)))                       (GeGLU, tanh gelu)
  h = h + ple_norm(ple_proj(gelu(ple_gate(h)) * ple[i]))        (when per_layer_input_dim > 0)
  out = h * layer_scalar                                         (a frozen scalar: no gradient)
Attention: q/k RMSNorm with scale, scale-free v norm, all per head before RoPE; attention scale
`attention_scale` (1.0 for Gemma 4). Sliding layers: head_dim, full RoPE with rope_theta, window.
Full layers: global_head_dim / global_num_kv_heads, proportional partial RoPE
(global_rope_fraction, global_rope_theta); with attention_k_eq_v no value projection (V is the raw
key projection). The last num_kv_shared_layers layers have no K/V weights: they reuse the finished
K/V of the last earlier layer of their kind (and a 2x MLP with double_wide_mlp_on_shared).
Embedding scaled by sqrt(D) in the weight dtype; tied head; logits soft-capped
(c * tanh(logits / c), in fp32). All norms use the Gemma cast order (scale in fp32, cast once).
With num_experts > 0 (the 26B-A4B MoE) every layer adds routed experts to its dense MLP:
  m = post_mlp_norm_1(mlp(mlp_norm(h))) + post_mlp_norm_2(experts(mlp_norm_2(h)))
  h = h + post_mlp_norm(m)
the router reading the raw residual h: softmax(proj(rms(h) * scale * D^-0.5)) → top-k →
renormalise → times per_expert_scale of the chosen experts (fp32). Routing statistics travel with
the layers and are returned by `forward_with_aux` as `moe_stats`; a selection bias `router_bias` [L, E] as in the llama family.

With encoder towers (`vision_layers` > 0: towers.py, vision.py) the embedding step merges their
soft tokens at the placeholder ids (`media=` of forward_with_aux and of the prefill's extend), and
with `mm_bidirectional_vision` the sliding layers let an image's tokens attend to each other both
ways (the dot-product op, which takes the image blocks; full layers stay causal).

The layers run as a pattern stack (MaxText/layers/stack.py) of their kinds (attention kind,
kv-shared or not): scanned, that is a repeating block (e.g. 4 sliding + 1 full) over the
non-shared layers, then the same block with shared K/V over the tail; K/V for the shared tail
travel in the carry. Parameter paths:
  scanned    decoder/runs/<run>/<member>/...   (leading axis: the block's repeat)
  unscanned  decoder/layers/<i>/...
`layer_location` maps an HF layer index to one of these.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from MaxText.layers import activations, quant, quant_vocab, sites, stack
from MaxText.layers.attention_ops import attention_op, dot_product_attention
from MaxText.layers.kv_cache import CacheGroup, KVCache
from MaxText.layers.linear import DenseGeneral, LayerKw, param
from MaxText.layers.mlp import ACTIVATIONS, GatedMLP
from MaxText.layers.moe import (RoutedExperts, empty_stats, finished_stats, load_balancing_terms,
                                record, route)
from MaxText.layers.norms import RMSNorm, rms_normalize
from MaxText.layers.rope import apply_rope
from MaxText.models.gemma4 import towers
from MaxText.models.model_config import ModelConfig
from MaxText.sharding.rules import constrain

ACT_BSD = ("activation_batch", "activation_length", "activation_embed")
ACT_BSHE = ("activation_batch", "activation_length", "activation_heads", None)
ACT_BSKE = ("activation_batch", "activation_length", "activation_kv_heads", None)


@dataclass(frozen=True)
class LayerKind:
  attention: str    # "sliding" | "full"
  kv_shared: bool   # reuses the K/V of the last earlier non-shared layer of the same attention kind

  def __str__(self) -> str:
    return self.attention + (" (kv-shared)" if self.kv_shared else "")


def attention_types(cfg: ModelConfig) -> tuple[str, ...]:
  """"sliding" or "full" for each layer: `attention_pattern` repeated over the layers."""
  pattern = cfg.attention_pattern or "f"
  bad = sorted(set(pattern) - {"s", "f"})
  if bad:
    raise ValueError(f"attention_pattern={cfg.attention_pattern!r}: letters must be s (sliding) "
                     f"or f (full), got {bad}")
  return tuple("sliding" if pattern[i % len(pattern)] == "s" else "full"
               for i in range(cfg.num_decoder_layers))


def head_dim_of(cfg: ModelConfig, attention: str) -> int:
  return (cfg.global_head_dim or cfg.head_dim) if attention == "full" else cfg.head_dim


def kv_heads_of(cfg: ModelConfig, attention: str) -> int:
  return (cfg.global_num_kv_heads or cfg.num_kv_heads) if attention == "full" else cfg.num_kv_heads


def first_kv_shared_layer(cfg: ModelConfig) -> int:
  return cfg.num_decoder_layers - cfg.num_kv_shared_layers


def layer_kinds(cfg: ModelConfig) -> tuple[LayerKind, ...]:
  first_shared = first_kv_shared_layer(cfg)
  return tuple(LayerKind(t, i >= first_shared) for i, t in enumerate(attention_types(cfg)))


def shared_kv_kinds(cfg: ModelConfig) -> tuple[str, ...]:
  """Attention kinds whose K/V the shared tail reads (they travel between layers)."""
  return tuple(sorted({k.attention for k in layer_kinds(cfg) if k.kv_shared}))


def cache_kind(cfg: ModelConfig, attention: str) -> KVCache:
  """The decoding cache of a layer kind: sliding layers keep a ring buffer of their window."""
  return KVCache(kv_heads_of(cfg, attention), head_dim_of(cfg, attention),
                 cfg.sliding_window if attention == "sliding" else 0, kernel=cfg.decode_attention)


def cache_rows(cfg: ModelConfig) -> tuple[int, ...]:
  """Per layer, its row in its attention kind's cache group: a layer with K/V its own (its rank
  among those of its kind), a kv-shared layer its producer's (the last earlier one of its kind)."""
  rows, count = [], {}
  for kind in layer_kinds(cfg):
    if not kind.kv_shared:
      count[kind.attention] = count.get(kind.attention, 0) + 1
    rows.append(count[kind.attention] - 1)
  return tuple(rows)


def decode_cache(cfg: ModelConfig) -> dict[str, CacheGroup]:
  """One cache group per attention kind ("sliding": ring buffers, "full"), one row per layer
  with K/V; the kv-shared tail stores nothing."""
  producers = [k.attention for k in layer_kinds(cfg) if not k.kv_shared]
  return {t: CacheGroup(cache_kind(cfg, t), producers.count(t)) for t in sorted(set(producers))}


def layer_location(cfg: ModelConfig, i: int) -> tuple[tuple, int | None]:
  """Where HF layer i lives in our params: (path prefix, index on the stacked axis or None)."""
  path, index = stack.location(layer_kinds(cfg), cfg.scan_layers, i)
  return ("decoder", *path), index


class Attention(nnx.Module):
  def __init__(self, cfg: ModelConfig, kind: LayerKind, *, rngs: nnx.Rngs):
    full = kind.attention == "full"
    D, H = cfg.emb_dim, cfg.num_query_heads
    E, K = head_dim_of(cfg, kind.attention), kv_heads_of(cfg, kind.attention)
    kw = LayerKw(rngs=rngs, dtype=cfg.compute_dtype, param_dtype=cfg.param_dtype)
    norm = functools.partial(RMSNorm, E, eps=cfg.norm_epsilon, logical_axis="head_dim",
                             cast_before_scale=False, **kw)
    self.query = DenseGeneral((D,), (H, E), ("embed", "heads", "head_dim"), **kw)
    self.query_norm = norm()
    self.out = DenseGeneral((H, E), (D,), ("heads", "head_dim", "embed"), **kw)
    self.kv_shared = kind.kv_shared
    if not kind.kv_shared:
      self.key = DenseGeneral((D,), (K, E), ("embed", "kv_heads", "head_dim"), **kw)
      self.key_norm = norm()
      self.value_norm = norm(use_scale=False)
      k_eq_v = full and cfg.attention_k_eq_v
      self.value = None if k_eq_v else DenseGeneral((D,), (K, E), ("embed", "kv_heads", "head_dim"),
                                                     **kw)
    self.rope_theta = (cfg.global_rope_theta or cfg.rope_theta) if full else cfg.rope_theta
    self.rope_fraction = cfg.global_rope_fraction if full else 1.0
    self.scale = cfg.attention_scale or E ** -0.5
    self.window = None if full else cfg.sliding_window
    self.op = attention_op(cfg)
    self.cache = cache_kind(cfg, kind.attention)

  def _q(self, x_BSD, positions_BS):
    q_BSHE = constrain(self.query_norm(self.query(x_BSD)), ACT_BSHE)
    return apply_rope(q_BSHE, positions_BS, self.rope_theta, self.rope_fraction)

  def _kv(self, x_BSD, positions_BS):
    raw_BSKE = constrain(self.key(x_BSD), ACT_BSKE)
    v_BSKE = raw_BSKE if self.value is None else constrain(self.value(x_BSD), ACT_BSKE)
    k_BSKE = apply_rope(self.key_norm(raw_BSKE), positions_BS, self.rope_theta, self.rope_fraction)
    return k_BSKE, self.value_norm(v_BSKE)

  def _attend(self, q_BSHE, k_BSKE, v_BSKE, segment_ids_BS, blocks_BS):
    """The training op; on a sliding layer with image blocks (bidirectional within an image) the
    dot-product op, the one that takes them."""
    if blocks_BS is not None and self.window is not None:
      return dot_product_attention(q_BSHE, k_BSKE, v_BSKE, segment_ids_BS, scale=self.scale,
                                   sliding_window=self.window, blocks_BS=blocks_BS)
    return self.op(q_BSHE, k_BSKE, v_BSKE, segment_ids_BS, scale=self.scale,
                   sliding_window=self.window)

  def __call__(self, x_BSD, positions_BS, segment_ids_BS, shared_kv=None, blocks_BS=None):
    """Returns (output, (k, v)); a kv-shared layer takes its (k, v) from `shared_kv`."""
    q_BSHE = self._q(x_BSD, positions_BS)
    k_BSKE, v_BSKE = (shared_kv if self.kv_shared  # pyright: ignore[reportGeneralTypeIssues]
                      else self._kv(x_BSD, positions_BS))  # (the stack passes shared_kv to such a layer)
    o_BSHE = self._attend(q_BSHE, k_BSKE, v_BSKE, segment_ids_BS, blocks_BS)
    return constrain(self.out(constrain(o_BSHE, ACT_BSHE)), ACT_BSD), (k_BSKE, v_BSKE)

  def extend(self, x_BSD, positions_BS, valid_BS, prefill: bool, shared_kv, group: dict | None,
             index, blocks_BS=None):
    """Decoding (`valid_BS`: the real tokens of right-padded rows). A layer with K/V stores the
    new tokens' in row `index` of its cache `group` (None: no cache); a kv-shared layer stores
    nothing: in a prefill it takes the producer's new K/V from `shared_kv` (as in training), in a
    step it reads the producer's row `index`, written earlier in the same step. A prefill attends
    within the new tokens with the training op, a step over the cache. Returns (output, (k, v),
    group)."""
    q_BSHE = self._q(x_BSD, positions_BS)
    k_BSKE = v_BSKE = None
    if not self.kv_shared:
      k_BSKE, v_BSKE = self._kv(x_BSD, positions_BS)
      if group is not None:
        group = self.cache.write(group, index, k_BSKE, v_BSKE, positions_BS, valid_BS)
    if prefill:
      if self.kv_shared:
        k_BSKE, v_BSKE = shared_kv
      o_BSHE = self._attend(q_BSHE, k_BSKE, v_BSKE, valid_BS.astype(jnp.int32), blocks_BS)
    else:
      if group is None:
        raise ValueError("a decoding step after the prefill attends over the cache: group is None")
      o_BSHE = self.cache.attend(group, index, q_BSHE, positions_BS, scale=self.scale)
    out_BSD = constrain(self.out(constrain(o_BSHE, ACT_BSHE)), ACT_BSD)
    return out_BSD, (k_BSKE, v_BSKE), group


class Router(nnx.Module):
  """Gemma 4's router: scale-free RMSNorm of the residual, times `scale` and D^-0.5, a linear map to
  the experts; top-k of the softmax, renormalised, times the chosen experts' `per_expert_scale`."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    D, E = cfg.emb_dim, cfg.num_experts
    self.proj = DenseGeneral((D,), (E,), ("embed", None), rngs=rngs, dtype=cfg.compute_dtype,
                             param_dtype=cfg.param_dtype)
    self.scale = param(rngs, (D,), ("norm",), std=None, dtype=cfg.param_dtype)
    self.per_expert_scale = param(rngs, (E,), (None,), std=None, dtype=cfg.param_dtype)
    self.eps, self.k, self.dtype = cfg.norm_epsilon, cfg.num_experts_per_tok, cfg.compute_dtype

  def __call__(self, r_BSD, bias_E):
    B, S, D = r_BSD.shape
    h_BSD = rms_normalize(r_BSD, self.eps).astype(self.dtype)
    h_BSD = h_BSD * self.scale[...].astype(self.dtype) * jnp.asarray(D ** -0.5, self.dtype)
    w_Tk, e_Tk, probs_TE = route(self.proj(h_BSD).reshape(B * S, -1), self.k, renormalize=True,
                                 bias_E=bias_E)
    w_Tk = w_Tk * self.per_expert_scale[...].astype(jnp.float32)[e_Tk]
    return w_Tk.reshape(B, S, self.k), e_Tk.reshape(B, S, self.k), probs_TE


class DecoderLayer(nnx.Module):
  def __init__(self, cfg: ModelConfig, kind: LayerKind, *, rngs: nnx.Rngs):
    kw = LayerKw(rngs=rngs, dtype=cfg.compute_dtype, param_dtype=cfg.param_dtype)
    norm = functools.partial(RMSNorm, cfg.emb_dim, eps=cfg.norm_epsilon, cast_before_scale=False,
                             **kw)
    self.kind = kind
    self.attn_norm, self.post_attn_norm = norm(), norm()
    self.attn = Attention(cfg, kind, rngs=rngs)
    self.mlp_norm, self.post_mlp_norm = norm(), norm()
    wide = 2 if kind.kv_shared and cfg.double_wide_mlp_on_shared else 1
    self.mlp = GatedMLP(cfg.emb_dim, cfg.mlp_dim * wide, cfg.mlp_activation, **kw)
    P = cfg.per_layer_input_dim
    if P:
      self.ple_gate = DenseGeneral((cfg.emb_dim,), (P,), ("embed", None), **kw)
      self.ple_proj = DenseGeneral((P,), (cfg.emb_dim,), (None, "embed"), **kw)
      self.ple_norm = norm()
    self.uses_ple = bool(P)
    self.layer_scalar = param(rngs, (1,), (None,), std=None, dtype=cfg.param_dtype)
    self.moe = bool(cfg.num_experts)
    if self.moe:
      self.router = Router(cfg, rngs=rngs)
      self.experts = RoutedExperts(cfg.num_experts, cfg.emb_dim, cfg.moe_mlp_dim,
                                   ACTIVATIONS[cfg.mlp_activation],
                                   capacity_factor=cfg.capacity_factor, dispatch=cfg.moe_dispatch,
                                 matmul=cfg.moe_matmul, tiles=tuple(cfg.moe_matmul_tiles),
                                   **kw)
      self.mlp_norm_2, self.post_mlp_norm_1, self.post_mlp_norm_2 = norm(), norm(), norm()

  def _after_attention(self, x_BSD, a_BSD, mask_BS, per_layer):
    """The rest of the layer after attention: (output, MoE routing statistics or None)."""
    x_BSD = x_BSD + sites.site("attn_out", self.post_attn_norm(a_BSD))
    m_BSD = self.mlp(self.mlp_norm(x_BSD))
    terms = None
    if self.moe:
      w_BSk, e_BSk, probs_TE = self.router(x_BSD, jax.lax.stop_gradient(per_layer["bias"]))
      y_BSD, dropped = self.experts(self.mlp_norm_2(x_BSD), w_BSk, e_BSk)
      m_BSD = self.post_mlp_norm_1(m_BSD) + self.post_mlp_norm_2(y_BSD)
      counts, probs = load_balancing_terms(probs_TE, e_BSk.reshape(-1, e_BSk.shape[-1]),
                                           mask_BS.reshape(-1))
      terms = (counts, probs, dropped)
    x_BSD = x_BSD + sites.site("mlp_out", self.post_mlp_norm(m_BSD))
    if self.uses_ple:
      g_BSP = activations.gelu_tanh(self.ple_gate(x_BSD)) * per_layer["ple"]
      x_BSD = x_BSD + self.ple_norm(self.ple_proj(g_BSP))
    # a frozen buffer in Hugging Face: part of the checkpoint, never trained
    x_BSD = x_BSD * jax.lax.stop_gradient(self.layer_scalar[...]).astype(x_BSD.dtype)
    return constrain(x_BSD, ACT_BSD), terms

  def _hand_on(self, kv: dict, new_kv) -> dict:
    """The K/V the kv-shared tail reads: a producer's replaces the earlier one of its kind."""
    if not self.kind.kv_shared and self.kind.attention in kv:
      kv = {**kv, self.kind.attention: new_kv}
    return kv

  def __call__(self, carry, positions_BS, segment_ids_BS, blocks_BS, per_layer):
    """carry = (x_BSD, {attention kind: (k, v)} handed to the kv-shared tail, MoE statistics);
    blocks_BS: image blocks (towers.vision_blocks) or None; per_layer = {"index": layer, "ple":
    its per-layer input, "bias": its router bias}."""
    x_BSD, kv, stats = carry
    shared = kv[self.kind.attention] if self.kind.kv_shared else None
    a_BSD, new_kv = self.attn(self.attn_norm(x_BSD), positions_BS, segment_ids_BS, shared,
                              blocks_BS)
    x_BSD, terms = self._after_attention(x_BSD, a_BSD, segment_ids_BS != 0, per_layer)
    if terms is not None:
      stats = record(stats, per_layer["index"], *terms)
    return x_BSD, self._hand_on(kv, new_kv), stats

  def extend(self, carry, positions_BS, valid_BS, prefill, blocks_BS, per_layer):
    """Decoding: carry = (x_BSD, K/V for the kv-shared tail (prefill), the cache);
    per_layer["cache_index"]: the row of its attention kind's cache group it writes (a kv-shared
    layer: the producer's row, which it reads)."""
    x_BSD, kv, cache = carry
    name = self.kind.attention
    shared = kv[name] if self.kind.kv_shared and prefill else None
    a_BSD, new_kv, group = self.attn.extend(
        self.attn_norm(x_BSD), positions_BS, valid_BS, prefill, shared,
        None if cache is None else cache[name], per_layer["cache_index"], blocks_BS)
    x_BSD, _ = self._after_attention(x_BSD, a_BSD, valid_BS, per_layer)
    if cache is not None and not self.kind.kv_shared:
      cache = {**cache, name: group}
    return x_BSD, self._hand_on(kv, new_kv) if prefill else kv, cache


class Transformer(nnx.Module):
  """`__call__(tokens_BS, positions_BS, segment_ids_BS) -> logits_BSV` (fp32, soft-capped)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    kw = LayerKw(rngs=rngs, dtype=cfg.compute_dtype, param_dtype=cfg.param_dtype)
    D, L, P = cfg.emb_dim, cfg.num_decoder_layers, cfg.per_layer_input_dim
    self.embedding = param(rngs, (cfg.vocab_size, D), ("vocab", "embed"), std=cfg.init_std,
                           dtype=cfg.param_dtype)
    if P:
      # columns (layer-major L*P) shard like the embedding's width, so fsdp splits the table
      self.ple_embedding = param(rngs, (cfg.per_layer_input_vocab_size or cfg.vocab_size, L * P),
                                 ("vocab", "embed"), std=cfg.init_std, dtype=cfg.param_dtype)
      self.ple_model_proj = DenseGeneral((D,), (L * P,), ("embed", None), **kw)
      self.ple_proj_norm = RMSNorm(P, eps=cfg.norm_epsilon, cast_before_scale=False, **kw)
    self.decoder = stack.PatternStack(lambda kind, r: DecoderLayer(cfg, kind, rngs=r),
                                      layer_kinds(cfg), scan=cfg.scan_layers,
                                      remat_policy=cfg.remat_policy, rngs=rngs,
                                      pipeline=True)
    self.final_norm = RMSNorm(D, eps=cfg.norm_epsilon, cast_before_scale=False, **kw)
    self.lm_head = None if cfg.tie_word_embeddings else DenseGeneral(
        (D,), (cfg.vocab_size,), ("embed", "vocab"), **kw)
    if cfg.num_experts:
      self.router_bias = nnx.Param(jnp.zeros((L, cfg.num_experts), cfg.param_dtype),
                                   logical_axes=("layers", "exp"))
    for tower in towers.towers_of(cfg):     # the encoder towers and their embedders (towers.py)
      setattr(self, tower.name, tower.build(cfg, rngs=rngs))
      setattr(self, "embed_" + tower.name, towers.Embedder(cfg, tower, rngs=rngs))

  def _per_layer_inputs(self, tokens_BS, x_BSD):
    """PLE: (token table lookup * sqrt(P) + RMSNorm(x0 @ W * D^-0.5)) * 2^-0.5 → [L, B, S, P]."""
    cfg, dtype = self.cfg, self.cfg.compute_dtype
    B, S = tokens_BS.shape
    L, P = cfg.num_decoder_layers, cfg.per_layer_input_dim
    rows_BSK = quant_vocab.rows(self, "ple_embedding", tokens_BS, cfg.param_dtype)
    tok_BSLP = (rows_BSK * jnp.asarray(P ** 0.5, rows_BSK.dtype)).astype(dtype).reshape(B, S, L, P)
    proj_BSLP = (self.ple_model_proj(x_BSD) * jnp.asarray(cfg.emb_dim ** -0.5, dtype)
                 ).reshape(B, S, L, P)
    ple_BSLP = (self.ple_proj_norm(proj_BSLP) + tok_BSLP) * jnp.asarray(2.0 ** -0.5, dtype)
    return ple_BSLP.transpose(2, 0, 1, 3)

  def __call__(self, tokens_BS, positions_BS, segment_ids_BS, *, media=None):
    return self.forward_with_aux(tokens_BS, positions_BS, segment_ids_BS, media=media)[0]

  def _inputs(self, tokens_BS, media=None):
    """(the scaled embeddings x_BSD with the towers' soft tokens merged in (towers.py), per-layer
    inputs: index, PLE, router bias; the image blocks of bidirectional attention or None)."""
    cfg = self.cfg
    ids = towers.placeholder_ids(cfg)
    ids_BS = (jnp.where(jnp.isin(tokens_BS, jnp.asarray(ids)), cfg.mm_pad_token_id, tokens_BS)
              if ids else tokens_BS)
    x_BSD = quant_vocab.rows(self, "embedding", ids_BS, cfg.param_dtype, ACT_BSD)
    x_BSD = constrain((x_BSD * jnp.asarray(cfg.emb_dim ** 0.5, x_BSD.dtype)
                       ).astype(cfg.compute_dtype), ACT_BSD)
    if media:
      x_BSD = constrain(towers.merge(cfg, self, x_BSD, tokens_BS, media), ACT_BSD)
    x_BSD = sites.site("embed_out", x_BSD)
    xs = {"index": jnp.arange(cfg.num_decoder_layers)}
    if cfg.per_layer_input_dim:
      xs["ple"] = self._per_layer_inputs(ids_BS, x_BSD)
    if cfg.num_experts:
      xs["bias"] = self.router_bias[...]
    blocks_BS = (towers.vision_blocks(cfg, tokens_BS)
                 if cfg.mm_bidirectional_vision and towers.has_images(media) else None)
    return x_BSD, xs, blocks_BS

  def _shared_kv(self, B: int, S: int) -> dict:
    """Zero K/V of each kind the kv-shared tail reads (replaced by its producer's)."""
    cfg = self.cfg
    return {t: (jnp.zeros((B, S, kv_heads_of(cfg, t), head_dim_of(cfg, t)), cfg.compute_dtype),) * 2
            for t in shared_kv_kinds(cfg)}

  def forward_with_aux(self, tokens_BS, positions_BS, segment_ids_BS, *, return_hidden=False,
                       media=None):
    """(logits, {"moe_stats": …} for MoE models, else {}); with `return_hidden` the final-norm
    hidden state x_BSD instead of the logits (the loss then applies `logits` chunk by chunk).
    `media`: the towers' inputs by transformers' names (towers.py), or None."""
    cfg = self.cfg
    x_BSD, xs, blocks_BS = self._inputs(tokens_BS, media)
    stats = empty_stats(cfg.num_decoder_layers, cfg.num_experts) if cfg.num_experts else {}
    kv = self._shared_kv(*tokens_BS.shape)
    x_BSD, _, stats = self.decoder((x_BSD, kv, stats), positions_BS, segment_ids_BS, blocks_BS,
                                   xs=xs)
    aux = {"moe_stats": finished_stats(stats, segment_ids_BS)} if cfg.num_experts else {}
    x_BSD = self.final_norm(x_BSD)
    return (x_BSD if return_hidden else self.logits(x_BSD)), aux

  def logits(self, x_BSD):
    """The LM head (tied or untied) on final-norm hidden states → fp32 logits [B, S, V],
    soft-capped."""
    cfg = self.cfg
    B, S, D = x_BSD.shape
    if self.lm_head is None:
      logits_BSV = quant_vocab.logits(self, "embedding", x_BSD.reshape(B * S, D)).reshape(B, S, -1)
    else:   # (a vocabulary slice of the kernel works too: the chunked loss may pass one)
      logits_BSV = self.lm_head(x_BSD, out_dtype=jnp.float32)
    if cfg.final_logit_softcap:
      c = cfg.final_logit_softcap
      logits_BSV = c * activations.tanh(logits_BSV / c)
    return constrain(logits_BSV, ("activation_batch", "activation_length", "activation_vocab"))

  def head_params(self):
    """The parameters `logits` reads, by path in the parameter dict (the head's module, with its
    adapters or quantized form): the family interface's name for the head's weights."""
    return quant_vocab.head_params(self, "embedding") if self.lm_head is None else (("lm_head",),)

  def unembedding(self):
    """The head's matrix [V, D] (the embedding when tied): what a logit lens multiplies by (before the soft-cap)."""
    if self.lm_head is None:
      return quant_vocab.dequantized(self, "embedding")
    return quant.float_kernel(self.lm_head).T

  # ---- decoding (MaxText/decoding/; the family interface: extend, logits) ------
  def extend(self, tokens_BS, positions_BS, valid_BS, cache, *, prefill: bool, media=None):
    """Decoding: new tokens at `positions_BS` (`valid_BS`: the real ones of right-padded rows) →
    (final-norm hidden states [B, S, D], the cache with their K/V; None: no cache). `prefill`:
    the prompts (positions 0..S-1) over an empty cache, with the towers' inputs `media` (their
    soft tokens are computed here, once per prompt); else one token per row."""
    if media and not prefill:
      raise ValueError("media go with the prompt's prefill, not a decoding step")
    x_BSD, xs, blocks_BS = self._inputs(tokens_BS, media)
    xs["cache_index"] = jnp.asarray(cache_rows(self.cfg))
    kv = self._shared_kv(*tokens_BS.shape) if prefill else {}
    x_BSD, _, cache = self.decoder((x_BSD, kv, cache), positions_BS, valid_BS, prefill, blocks_BS,
                                   xs=xs, method="extend")
    return self.final_norm(x_BSD), cache
