"""The small typed config a model receives (model code never reads the global `Config`)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from MaxText.config.schema import Config


@dataclass(frozen=True)
class ModelConfig:
  decoder_block: str
  vocab_size: int
  emb_dim: int
  num_decoder_layers: int
  num_query_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  mlp_activation: str
  norm_epsilon: float
  use_qk_norm: bool
  tie_word_embeddings: bool
  rope_theta: float
  max_position_embeddings: int
  init_std: float
  dtype: str
  weight_dtype: str
  scan_layers: bool
  remat_policy: str
  attention: str          # resolved (`select_attention`): dot_product, flash, splash (TPU), cudnn
  flash_block_q: int
  flash_block_kv: int
  attention_pattern: str
  sliding_window: int
  attention_scale: float
  global_head_dim: int
  global_num_kv_heads: int
  global_rope_theta: float
  global_rope_fraction: float
  attention_k_eq_v: bool
  num_kv_shared_layers: int
  double_wide_mlp_on_shared: bool
  per_layer_input_dim: int
  per_layer_input_vocab_size: int
  final_logit_softcap: float
  num_experts: int
  num_experts_per_tok: int
  moe_mlp_dim: int
  norm_topk_prob: bool
  shared_expert_mlp_dim: int
  capacity_factor: float
  moe_dispatch: str

  @classmethod
  def from_config(cls, cfg: Config) -> "ModelConfig":
    from MaxText.layers.attention_ops import select_attention
    values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)}
    values["attention"] = select_attention(cfg.attention, jax.default_backend())
    return cls(**values)

  # ---- per-layer attention layout (generic: any family may read it) -----------------------------
  def layer_types(self) -> tuple[str, ...]:
    """"sliding" or "full" for each layer: `attention_pattern` repeated over the layers."""
    pattern = self.attention_pattern or "f"
    bad = sorted(set(pattern) - {"s", "f"})
    if bad:
      raise ValueError(f"attention_pattern={self.attention_pattern!r}: letters must be s (sliding) "
                       f"or f (full), got {bad}")
    return tuple("sliding" if pattern[i % len(pattern)] == "s" else "full"
                 for i in range(self.num_decoder_layers))

  def head_dim_of(self, layer_type: str) -> int:
    return (self.global_head_dim or self.head_dim) if layer_type == "full" else self.head_dim

  def kv_heads_of(self, layer_type: str) -> int:
    return (self.global_num_kv_heads or self.num_kv_heads) if layer_type == "full" else self.num_kv_heads

  def first_kv_shared_layer(self) -> int:
    return self.num_decoder_layers - self.num_kv_shared_layers

  @property
  def compute_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.dtype)

  @property
  def param_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.weight_dtype)
