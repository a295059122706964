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
  attention: str          # resolved: never "autoselected"
  flash_block_q: int
  flash_block_kv: int

  @classmethod
  def from_config(cls, cfg: Config) -> "ModelConfig":
    from MaxText.layers.attention_ops import select_attention
    values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)}
    values["attention"] = select_attention(cfg.attention, jax.default_backend())
    return cls(**values)

  @property
  def compute_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.dtype)

  @property
  def param_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.weight_dtype)
