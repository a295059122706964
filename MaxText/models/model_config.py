"""The small typed config a model receives (model code never reads the global `Config`): the
schema's keys marked `model=True` (MaxText/config/schema.py), as a frozen, hashable dataclass (list
keys become tuples). `attention` holds the op that runs on this platform (`select_attention`),
`hot_path` the layers' path (`select_hot_path`: tuned or plain), `param_init_rng` the random
generator of a fresh init (`select_init_rng`)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from MaxText.backend.hot_path import select_hot_path
from MaxText.config.schema import MODEL_KEYS, Config, view
from MaxText.layers import attention_ops


def select_init_rng(name: str, platform: str) -> str:
  """`param_init_rng` for a platform: auto is JAX's threefry on CPU (whose init programs compile
  quickly there, and whose values every CPU run has had) and XLA's RngBitGenerator elsewhere (a
  TPU compiles threefry's init program in 20-30 s, rbg's in a few: benchmarks/RESULTS.md)."""
  if name == "auto":
    return "threefry2x32" if platform == "cpu" else "rbg"
  return name


class _Methods:
  @classmethod
  def from_config(cls, cfg: Config) -> "ModelConfig":
    mcfg = super().from_config(cfg)  # the schema view: every model key of `cfg`
    platform = jax.default_backend()
    return dataclasses.replace(mcfg, attention=attention_ops.select_attention(cfg.attention, platform),
                               hot_path=select_hot_path(cfg.hot_path, platform),
                               param_init_rng=select_init_rng(mcfg.param_init_rng, platform))

  @property
  def compute_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.dtype)

  @property
  def param_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.weight_dtype)


ModelConfig = view("ModelConfig", MODEL_KEYS, __name__, bases=(_Methods,))
