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
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from MaxText.layers import stack
from MaxText.layers.attention_ops import attention_op
from MaxText.layers.linear import DenseGeneral, param
from MaxText.layers.mlp import GatedMLP
from MaxText.layers.moe import RoutedMLP, finished_stats, record, stack_inputs
from MaxText.layers.norms import RMSNorm
from MaxText.layers.rope import apply_rope
from MaxText.models.model_config import ModelConfig
from MaxText.sharding.rules import constrain

DENSE, MOE = "dense", "moe"

ACT_BSD = ("activation_batch", "activation_length", "activation_embed")
ACT_BSHE = ("activation_batch", "activation_length", "activation_heads", None)
ACT_BSKE = ("activation_batch", "activation_length", "activation_kv_heads", None)


class Attention(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    D, H, K, E = cfg.emb_dim, cfg.num_query_heads, cfg.num_kv_heads, cfg.head_dim
    kw = dict(rngs=rngs, dtype=cfg.compute_dtype, param_dtype=cfg.param_dtype)
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

  def __call__(self, x_BSD, positions_BS, segment_ids_BS):
    q_BSHE = constrain(self.query(x_BSD), ACT_BSHE)
    k_BSKE = constrain(self.key(x_BSD), ACT_BSKE)
    v_BSKE = constrain(self.value(x_BSD), ACT_BSKE)
    if self.query_norm is not None:
      q_BSHE, k_BSKE = self.query_norm(q_BSHE), self.key_norm(k_BSKE)
    q_BSHE = apply_rope(q_BSHE, positions_BS, self.rope_theta)
    k_BSKE = apply_rope(k_BSKE, positions_BS, self.rope_theta)
    o_BSHE = constrain(self.op(q_BSHE, k_BSKE, v_BSKE, segment_ids_BS, scale=self.scale), ACT_BSHE)
    return constrain(self.out(o_BSHE), ACT_BSD)


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
    kw = dict(rngs=rngs, dtype=cfg.compute_dtype, param_dtype=cfg.param_dtype)
    self.attn_norm = RMSNorm(cfg.emb_dim, eps=cfg.norm_epsilon, **kw)
    self.attn = Attention(cfg, rngs=rngs)
    self.mlp_norm = RMSNorm(cfg.emb_dim, eps=cfg.norm_epsilon, **kw)
    self.moe = kind == MOE
    self.mlp = (RoutedMLP(cfg, rngs=rngs) if self.moe else
                GatedMLP(cfg.emb_dim, cfg.mlp_dim, cfg.mlp_activation, **kw))

  def __call__(self, carry, positions_BS, segment_ids_BS, per_layer=None):
    """carry = (x_BSD, moe stats); per_layer (models with MoE layers) = {"moe_layer": this layer's
    row of the statistics and the bias, "bias": its bias [E]}."""
    x_BSD, stats = carry
    x_BSD = x_BSD + self.attn(self.attn_norm(x_BSD), positions_BS, segment_ids_BS)
    if self.moe:
      y_BSD, (counts, probs, dropped) = self.mlp(self.mlp_norm(x_BSD), segment_ids_BS != 0,
                                                 jax.lax.stop_gradient(per_layer["bias"]))
      stats = record(stats, per_layer["moe_layer"], counts, probs, dropped)
    else:
      y_BSD = self.mlp(self.mlp_norm(x_BSD))
    return constrain(x_BSD + y_BSD, ACT_BSD), stats


class Transformer(nnx.Module):
  """`__call__(tokens_BS, positions_BS, segment_ids_BS) -> logits_BSV` (fp32)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    kw = dict(rngs=rngs, dtype=cfg.compute_dtype, param_dtype=cfg.param_dtype)
    self.embedding = param(rngs, (cfg.vocab_size, cfg.emb_dim), ("vocab", "embed"),
                           std=cfg.init_std, dtype=cfg.param_dtype)
    self.decoder = stack.PatternStack(lambda kind, r: DecoderLayer(cfg, kind, rngs=r),
                                      layer_kinds(cfg), scan=cfg.scan_layers,
                                      remat_policy=cfg.remat_policy, rngs=rngs)
    self.final_norm = RMSNorm(cfg.emb_dim, eps=cfg.norm_epsilon, **kw)
    self.lm_head = None if cfg.tie_word_embeddings else DenseGeneral(
        (cfg.emb_dim,), (cfg.vocab_size,), ("embed", "vocab"), **kw)
    self.moe_layers = moe_layers(cfg)
    if self.moe_layers:
      self.router_bias = nnx.Param(jnp.zeros((len(self.moe_layers), cfg.num_experts),
                                             cfg.param_dtype), logical_axes=("layers", "exp"))

  def __call__(self, tokens_BS, positions_BS, segment_ids_BS):
    return self.forward_with_aux(tokens_BS, positions_BS, segment_ids_BS)[0]

  def forward_with_aux(self, tokens_BS, positions_BS, segment_ids_BS):
    """(logits, {"moe_stats": …} for models with MoE layers, else {})."""
    cfg, dtype = self.cfg, self.cfg.compute_dtype
    x_BSD = constrain(jnp.take(self.embedding[...], tokens_BS, axis=0).astype(dtype), ACT_BSD)
    stats, xs = {}, None
    if self.moe_layers:
      stats, xs = stack_inputs(self.moe_layers, cfg.num_decoder_layers, self.router_bias[...])
    x_BSD, stats = self.decoder((x_BSD, stats), positions_BS, segment_ids_BS, xs=xs)
    aux = {"moe_stats": finished_stats(stats, segment_ids_BS)} if self.moe_layers else {}
    x_BSD = self.final_norm(x_BSD)
    if self.lm_head is None:
      logits_BSV = jnp.einsum("bsd,vd->bsv", x_BSD, self.embedding[...].astype(dtype))
    else:
      logits_BSV = self.lm_head(x_BSD)
    return constrain(logits_BSV.astype(jnp.float32),
                     ("activation_batch", "activation_length", "activation_vocab")), aux
