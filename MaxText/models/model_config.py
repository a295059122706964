"""The small typed config a model receives (model code never reads the global `Config`): the
schema's keys marked `model=True` (MaxText/config/schema.py), as a frozen, hashable dataclass (list
keys become tuples). `attention` holds the op that runs on this platform (`select_attention`),
`hot_path` the layers' path (`select_hot_path`: tuned or plain)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from MaxText.backend.hot_path import select_hot_path
from MaxText.config.schema import MODEL_KEYS, Config, view
from MaxText.layers import attention_ops


class _Methods:
  @classmethod
  def from_config(cls, cfg: Config) -> "ModelConfig":
    mcfg = super().from_config(cfg)  # the schema view: every model key of `cfg`
    platform = jax.default_backend()
    return dataclasses.replace(mcfg, attention=attention_ops.select_attention(cfg.attention, platform),
                               hot_path=select_hot_path(cfg.hot_path, platform))

  @property
  def compute_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.dtype)

  @property
  def param_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.weight_dtype)


ModelConfig = view("ModelConfig", MODEL_KEYS, __name__, bases=(_Methods,))
