"""Llama / Qwen3-style dense decoder.

Conventions
  dimension letters: B batch, S query sequence, T key sequence, D model width (emb_dim),
  H query heads, K kv heads (H % K == 0), E head dim, F mlp hidden, V vocab, L layers.
  Arrays are named by shape (`x_BSD`); parameters carry logical axis names (never mesh axes),
  mapped to the mesh by the `logical_axis_rules` table in configs/base.yml.

Block: x + Attn(RMSNorm(x)) then + MLP(RMSNorm(x)); RoPE on q and k (optionally after a per-head
q/k RMSNorm, as in Qwen3); final RMSNorm; tied or untied LM head. Logits are returned in fp32.

Layer kinds: "dense" (gated MLP of width mlp_dim) or, with num_experts > 0, "moe" (a routed MoE,
Qwen3-MoE / DeepSeek style; MaxText/layers/moe.py). Every layer is a MoE layer except the first
`first_k_dense_layers`, those in `mlp_only_layers` and those with (i + 1) % decoder_sparse_step != 0.
The layers run as a pattern stack (MaxText/layers/stack.py: e.g. [dense] x 1 then [moe] x L-1).
The MoE layers carry their routing statistics (copies and router probability per expert, dropped
copies), returned by `forward_with_aux` as `moe_stats` [MoE layers, E] for the load-balancing loss
and metrics, and read a selection bias `router_bias` [MoE layers, E] (aux-loss-free balancing;
changed by the family's aux terms after each step, never by gradients).

With mtp_num_layers > 0 the model holds a multi-token-prediction block (`mtp/`,
MaxText/layers/mtp.py: depth k predicts the token k+1 ahead through one decoder layer of its own
and the shared head; a layer of the last decoder layer's kind here, Qwen3-Next's its own).
`forward_with_aux(..., mtp=True)` returns its depths' final-norm hidden states as
aux["mtp_hidden"] [depths, B, S, D] (the loss: MaxText/losses/mtp.py); `mtp_extend` runs one depth
in decoding (speculative drafting, MaxText/decoding/speculative.py) over its own cache group MTP.
"""
from __future__ import annotations

from typing import Any, cast

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from MaxText.backend import hot_path
from MaxText.layers import quant, quant_vocab, sites, stack
from MaxText.layers.mtp import MTPBlock, MTPLayer, shifted
from MaxText.layers.attention_ops import attention_op
from MaxText.layers.kv_cache import CacheGroup, KVCache
from MaxText.layers.linear import DenseGeneral, LayerKw, fused_dense, param
from MaxText.layers.mlp import GatedMLP
from MaxText.layers.moe import RoutedMLP, empty_stats, finished_stats, record, stack_inputs
from MaxText.layers.norms import RMSNorm
from MaxText.layers.rope import apply_rope
from MaxText.layers.saved import OUT_PROJ, QKV_PROJ
from MaxText.models.model_config import ModelConfig
from MaxText.sharding.rules import constrain

DENSE, MOE = "dense", "moe"
KV = "kv"   # the decoding cache group of the attention layers
MTP = "mtp"   # the decoding cache group of the MTP block's layers (one row per depth)

ACT_BSD = ("activation_batch", "activation_length", "activation_embed")
ACT_BSHE = ("activation_batch", "activation_length", "activation_heads", None)
ACT_BSKE = ("activation_batch", "activation_length", "activation_kv_heads", None)


class Attention(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    D, H, K, E = cfg.emb_dim, cfg.num_query_heads, cfg.num_kv_heads, cfg.head_dim
    kw = LayerKw(rngs=rngs, dtype=cfg.compute_dtype, param_dtype=cfg.param_dtype)
    self.query = DenseGeneral((D,), (H, E), ("embed", "heads", "head_dim"), **kw)
    self.key = DenseGeneral((D,), (K, E), ("embed", "kv_heads", "head_dim"), **kw)
    self.value = DenseGeneral((D,), (K, E), ("embed", "kv_heads", "head_dim"), **kw)
    self.out = DenseGeneral((H, E), (D,), ("heads", "head_dim", "embed"), **kw)
    if cfg.use_qk_norm:
      self.query_norm = RMSNorm(E, eps=cfg.norm_epsilon, logical_axis="head_dim", **kw)
      self.key_norm = RMSNorm(E, eps=cfg.norm_epsilon, logical_axis="head_dim", **kw)
    else:
      self.query_norm = self.key_norm = None
    self.rope_theta = cfg.rope_theta
    self.scale = E ** -0.5
    self.op = attention_op(cfg)
    self.cache = KVCache(K, E, kernel=cfg.decode_attention)

  def _qkv(self, x_BSD, positions_BS, flat: bool = False):
    projected = ([l.flat(x_BSD) for l in (self.query, self.key, self.value)] if flat else
                 fused_dense((self.query, self.key, self.value), x_BSD))
    q_BSHE, k_BSKE, v_BSKE = (checkpoint_name(y, QKV_PROJ) for y in projected)
    q_BSHE = constrain(q_BSHE, ACT_BSHE)
    k_BSKE, v_BSKE = constrain(k_BSKE, ACT_BSKE), constrain(v_BSKE, ACT_BSKE)
    if self.query_norm is not None and self.key_norm is not None:   # (set together)
      q_BSHE, k_BSKE = self.query_norm(q_BSHE), self.key_norm(k_BSKE)
    q_BSHE = apply_rope(q_BSHE, positions_BS, self.rope_theta)
    k_BSKE = apply_rope(k_BSKE, positions_BS, self.rope_theta)
    return q_BSHE, k_BSKE, v_BSKE

  def __call__(self, x_BSD, positions_BS, segment_ids_BS):
    q_BSHE, k_BSKE, v_BSKE = self._qkv(x_BSD, positions_BS)
    o_BSHE = constrain(self.op(q_BSHE, k_BSKE, v_BSKE, segment_ids_BS, scale=self.scale), ACT_BSHE)
    return constrain(checkpoint_name(self.out(o_BSHE), OUT_PROJ), ACT_BSD)

  def extend(self, x_BSD, positions_BS, valid_BS, prefill: bool, group: dict | None, index):
    """Decoding (`valid_BS`: the real tokens of right-padded rows): stores the new K/V in row
    `index` of the cache `group` (None: no cache, e.g. scoring); a prefill (positions 0..S-1)
    attends within the new tokens with the training op, a step over the cache after its write.
    Returns (output, group)."""
    # a decoding step on XLA's plain path (GPU / TPU): 2-D matmuls (DenseGeneral.flat; the tuned
    # CPU path's matmuls are 2-D already, and its q/k/v one fused matmul)
    step = not prefill and x_BSD.shape[1] == 1 and not hot_path.tuned()
    q_BSHE, k_BSKE, v_BSKE = self._qkv(x_BSD, positions_BS, flat=step)
    o_BSHE, group = self.cache.extend(group, index, self.op, q_BSHE, k_BSKE, v_BSKE, positions_BS,
                                      valid_BS, prefill=prefill, scale=self.scale)
    o_BSHE = constrain(o_BSHE, ACT_BSHE)
    return constrain(self.out.flat(o_BSHE) if step else self.out(o_BSHE), ACT_BSD), group


def is_moe_layer(cfg: ModelConfig, i: int) -> bool:
  return (cfg.num_experts > 0 and i >= cfg.first_k_dense_layers and i not in cfg.mlp_only_layers
          and (i + 1) % cfg.decoder_sparse_step == 0)


def layer_kinds(cfg: ModelConfig) -> tuple[str, ...]:
  return tuple(MOE if is_moe_layer(cfg, i) else DENSE for i in range(cfg.num_decoder_layers))


def moe_layers(cfg: ModelConfig) -> tuple[int, ...]:
  return tuple(i for i, kind in enumerate(layer_kinds(cfg)) if kind == MOE)


def layer_location(cfg: ModelConfig, i: int) -> tuple[tuple, int | None]:
  """Where layer i lives in our params: (path prefix, index on the stacked axis or None)."""
  path, index = stack.location(layer_kinds(cfg), cfg.scan_layers, i)
  return ("decoder", *path), index


class DecoderLayer(nnx.Module):
  def __init__(self, cfg: ModelConfig, kind: str, *, rngs: nnx.Rngs):
    kw = LayerKw(rngs=rngs, dtype=cfg.compute_dtype, param_dtype=cfg.param_dtype)
    self.attn_norm = RMSNorm(cfg.emb_dim, eps=cfg.norm_epsilon, **kw)
    self.attn = Attention(cfg, rngs=rngs)
    self.mlp_norm = RMSNorm(cfg.emb_dim, eps=cfg.norm_epsilon, **kw)
    self.moe = kind == MOE
    self.mlp = (RoutedMLP(cfg, rngs=rngs) if self.moe else
                GatedMLP(cfg.emb_dim, cfg.mlp_dim, cfg.mlp_activation, **kw))

  def _mlp(self, x_BSD, mask_BS, per_layer):
    """x + MLP(norm(x)), and for a MoE layer its routing statistics (else None)."""
    if self.moe:
      y_BSD, terms = self.mlp(self.mlp_norm(x_BSD), mask_BS,  # pyright: ignore[reportCallIssue]
                              jax.lax.stop_gradient(per_layer["bias"]))
    else:
      y_BSD, terms = self.mlp(self.mlp_norm(x_BSD)), None  # pyright: ignore[reportCallIssue] (GatedMLP)
    return constrain(x_BSD + sites.site("mlp_out", y_BSD), ACT_BSD), terms

  def __call__(self, carry, positions_BS, segment_ids_BS, per_layer=None):
    """carry = (x_BSD, moe stats); per_layer (models with MoE layers) = {"moe_layer": this layer's
    row of the statistics and the bias, "bias": its bias [E]}."""
    x_BSD, stats = carry
    x_BSD = x_BSD + sites.site("attn_out", self.attn(self.attn_norm(x_BSD), positions_BS,
                                                     segment_ids_BS))
    x_BSD, terms = self._mlp(x_BSD, segment_ids_BS != 0, per_layer)
    if terms is not None:
      assert per_layer is not None, "a MoE layer runs with its per-layer inputs"
      stats = record(stats, per_layer["moe_layer"], *terms)
    return x_BSD, stats

  def extend(self, carry, positions_BS, valid_BS, prefill, per_layer):
    """Decoding: carry = (x_BSD, the cache); per_layer["cache_index"]: this layer's row."""
    x_BSD, cache = carry
    a_BSD, group = self.attn.extend(self.attn_norm(x_BSD), positions_BS, valid_BS, prefill,
                                    None if cache is None else cache[KV],
                                    per_layer["cache_index"])
    x_BSD, _ = self._mlp(x_BSD + a_BSD, valid_BS, per_layer)
    return x_BSD, None if cache is None else {**cache, KV: group}


class Transformer(nnx.Module):
  """`__call__(tokens_BS, positions_BS, segment_ids_BS) -> logits_BSV` (fp32).

  A family built on this one (Qwen3-Next) subclasses it and replaces the parts that differ through
  the hooks below — its layer kinds and layers, its final norm — instead of copying `__init__`."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    kw = LayerKw(rngs=rngs, dtype=cfg.compute_dtype, param_dtype=cfg.param_dtype)
    self.embedding = param(rngs, (cfg.vocab_size, cfg.emb_dim), ("vocab", "embed"),
                           std=cfg.init_std, dtype=cfg.param_dtype)
    self.decoder = stack.PatternStack(lambda kind, r: self.new_layer(cfg, kind, r),
                                      self.kinds_of(cfg), scan=cfg.scan_layers,
                                      remat_policy=cfg.remat_policy, rngs=rngs,
                                      pipeline=True)
    self.final_norm = self.new_final_norm(cfg, rngs)
    self.lm_head = None if cfg.tie_word_embeddings else DenseGeneral(
        (cfg.emb_dim,), (cfg.vocab_size,), ("embed", "vocab"), **kw)
    self.moe_layers = self.moe_layers_of(cfg)
    if self.moe_layers:
      self.router_bias = nnx.Param(jnp.zeros((len(self.moe_layers), cfg.num_experts),
                                             cfg.param_dtype), logical_axes=("layers", "exp"))
    self.mtp = MTPBlock(cfg.emb_dim, lambda: self.new_final_norm(cfg, rngs),
                        [self.new_mtp_layer(cfg, j, rngs) for j in range(cfg.mtp_num_layers)],
                        rngs=rngs, dtype=cfg.compute_dtype, param_dtype=cfg.param_dtype
                        ) if cfg.mtp_num_layers else None

  # ---- the hooks of a family built on this one ----------------------------------------------------
  kinds_of = staticmethod(layer_kinds)     # the layer kinds, one per layer
  moe_layers_of = staticmethod(moe_layers)  # the indices of the MoE layers among them
  attention_group = KV                      # the cache group its attention layers read

  def new_mtp_layer(self, cfg: ModelConfig, j: int, rngs: nnx.Rngs) -> MTPLayer:
    """The MTP block's layer of depth j + 1: a decoder layer of the last decoder layer's kind."""
    # (the family's decoder layers, `new_layer`'s, have the forward and `extend` of an MTPLayer)
    return cast(MTPLayer, self.new_layer(cfg, self.kinds_of(cfg)[-1], rngs))

  def new_layer(self, cfg: ModelConfig, kind, rngs: nnx.Rngs) -> nnx.Module:
    return DecoderLayer(cfg, kind, rngs=rngs)

  def new_final_norm(self, cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
    return RMSNorm(cfg.emb_dim, eps=cfg.norm_epsilon, rngs=rngs, dtype=cfg.compute_dtype,
                   param_dtype=cfg.param_dtype)

  def __call__(self, tokens_BS, positions_BS, segment_ids_BS):
    return self.forward_with_aux(tokens_BS, positions_BS, segment_ids_BS)[0]

  def _embed(self, tokens_BS):
    x_BSD = quant_vocab.rows(self, "embedding", tokens_BS, self.cfg.param_dtype, ACT_BSD)
    return sites.site("embed_out", x_BSD.astype(self.cfg.compute_dtype))

  def _moe_inputs(self) -> dict:
    """Per-layer inputs of the MoE layers: their row of the statistics and their router bias."""
    if not self.moe_layers:
      return {}
    return stack_inputs(self.moe_layers, self.cfg.num_decoder_layers, self.router_bias[...])[1]

  def forward_with_aux(self, tokens_BS, positions_BS, segment_ids_BS, *, return_hidden=False,
                       mtp=False):
    """(logits, {"moe_stats": …} for models with MoE layers, else {}); with `return_hidden` the
    final-norm hidden state x_BSD instead of the logits (the loss then applies `logits` chunk by
    chunk); with `mtp` (a model with an MTP block) also aux["mtp_hidden"] [depths, B, S, D]."""
    cfg = self.cfg
    x_BSD = self._embed(tokens_BS)
    stats, xs = {}, None
    if self.moe_layers:
      stats, xs = stack_inputs(self.moe_layers, cfg.num_decoder_layers, self.router_bias[...])
    x_BSD, stats = self.decoder((x_BSD, stats), positions_BS, segment_ids_BS, xs=xs)
    aux: dict[str, Any] = ({"moe_stats": finished_stats(stats, segment_ids_BS)}
                           if self.moe_layers else {})
    x_BSD = self.final_norm(x_BSD)
    if mtp and self.mtp is not None:
      aux["mtp_hidden"] = self.mtp_hidden(x_BSD, tokens_BS, positions_BS, segment_ids_BS)
    return (x_BSD if return_hidden else self.logits(x_BSD)), aux

  # ---- multi-token prediction (MaxText/layers/mtp.py) ----------------------------------------
  def _mtp_block(self) -> MTPBlock:
    if self.mtp is None:
      raise ValueError("this model has no MTP block (mtp_num_layers: 0)")
    return self.mtp

  def _mtp_layer_inputs(self, j: int):
    """(the routing statistics a MoE MTP layer records into, its per-layer inputs): its own
    statistics (not in the balancing loss) and a zero selection bias; nothing for a dense one."""
    if not getattr(self._mtp_block().layers[j], "moe", False):
      return {}, {}
    E = self.cfg.num_experts
    return empty_stats(1, E), {"moe_layer": jnp.int32(0),
                               "bias": jnp.zeros((E,), self.cfg.param_dtype)}

  def mtp_hidden(self, x_BSD, tokens_BS, positions_BS, segment_ids_BS):
    """Every depth's final-norm hidden state [depths, B, S, D] over a training row: depth k at t
    reads depth k-1's at t and the token k ahead (the row's tokens shifted; past a document's end
    the loss masks what it predicts)."""
    mtp, out = self._mtp_block(), []
    for j in range(len(mtp.layers)):
      u_BSD = mtp.combine(self._embed(shifted(tokens_BS, j + 1)), x_BSD)
      stats, per_layer = self._mtp_layer_inputs(j)
      u_BSD, _ = mtp.layers[j]((u_BSD, stats), positions_BS, segment_ids_BS, per_layer or None)
      x_BSD = mtp.norm(u_BSD)
      out.append(x_BSD)
    return jnp.stack(out)

  def mtp_extend(self, tokens_BS, hidden_BSD, positions_BS, valid_BS, cache, *, prefill: bool,
                 depth: int = 0):
    """Decoding with the MTP block: layer `depth` on the tokens one ahead of `positions_BS`
    (`tokens_BS`) and the hidden states at them (`hidden_BSD`: the decoder's final-norm output, or
    the previous depth's) → (its final-norm hidden states, the cache with its K/V in row `depth` of
    group MTP). `prefill` as `extend`; else any number of tokens continuing the cache."""
    mtp = self._mtp_block()
    _, per_layer = self._mtp_layer_inputs(depth)
    u_BSD = mtp.combine(self._embed(tokens_BS), hidden_BSD)
    groups = None if cache is None else {self.attention_group: cache[MTP]}
    u_BSD, groups = mtp.layers[depth].extend(
        (u_BSD, groups), positions_BS, valid_BS, prefill,
        {**per_layer, "cache_index": jnp.int32(depth)})
    if cache is not None:
      cache = {**cache, MTP: groups[self.attention_group]}
    return mtp.norm(u_BSD), cache

  def logits(self, x_BSD):
    """The LM head (tied or untied) on final-norm hidden states → fp32 logits [B, S, V], straight
    from the fp32 accumulator of the head's matmul (training, chunked loss and decoding)."""
    B, S, D = x_BSD.shape
    if self.lm_head is None:
      logits_BSV = quant_vocab.logits(self, "embedding", x_BSD.reshape(B * S, D)).reshape(B, S, -1)
    else:   # (a vocabulary slice of the kernel works too: the chunked loss may pass one)
      logits_BSV = self.lm_head(x_BSD, out_dtype=jnp.float32)
    return constrain(logits_BSV, ("activation_batch", "activation_length", "activation_vocab"))

  def head_params(self):
    """The parameters `logits` reads, by path in the parameter dict (the head's module, with its
    adapters or quantized form): the family interface's name for the head's weights."""
    return quant_vocab.head_params(self, "embedding") if self.lm_head is None else (("lm_head",),)

  def unembedding(self):
    """The head's matrix [V, D] (the embedding when tied): what a logit lens multiplies by
    (floats: an integer head dequantized)."""
    if self.lm_head is None:
      return quant_vocab.dequantized(self, "embedding")
    return quant.float_kernel(self.lm_head).T

  # ---- decoding (MaxText/decoding/; the family interface: extend, logits) ------
  def extend(self, tokens_BS, positions_BS, valid_BS, cache, *, prefill: bool):
    """Decoding: new tokens at `positions_BS` (`valid_BS`: the real ones of right-padded rows) →
    (final-norm hidden states [B, S, D], the cache with their K/V; None: no cache). `prefill`:
    the prompts (positions 0..S-1) over an empty cache; else one token per row."""
    xs = {"cache_index": jnp.arange(self.cfg.num_decoder_layers), **self._moe_inputs()}
    x_BSD, cache = self.decoder((self._embed(tokens_BS), cache), positions_BS, valid_BS, prefill,
                                xs=xs, method="extend")
    return self.final_norm(x_BSD), cache


def decode_cache(cfg: ModelConfig) -> dict[str, CacheGroup]:
  """Every layer keeps full-attention K/V (one group, one row per layer); the MTP block's layers
  theirs (group MTP, one row per depth)."""
  return {KV: CacheGroup(KVCache(cfg.num_kv_heads, cfg.head_dim, kernel=cfg.decode_attention), cfg.num_decoder_layers),
          **mtp_cache(cfg)}


def mtp_cache(cfg: ModelConfig) -> dict[str, CacheGroup]:
  """The MTP block's decoding cache: full-attention K/V per depth ({} without the block)."""
  if not cfg.mtp_num_layers:
    return {}
  return {MTP: CacheGroup(KVCache(cfg.num_kv_heads, cfg.head_dim, kernel=cfg.decode_attention), cfg.mtp_num_layers)}
