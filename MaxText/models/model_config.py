"""The small typed config a model receives (model code never reads the global `Config`): the
schema's keys marked `model=True` (MaxText/config/schema.py), as a frozen, hashable dataclass (list
keys become tuples). `attention` holds the op that runs on this platform (`select_attention`),
`hot_path` the layers' path (`select_hot_path`: tuned or plain), `param_init_rng` the random
generator of a fresh init (`select_init_rng`), `decode_attention` the decoding step's attention
(`select_decode_attention`: auto is the Pallas kernel on a TPU). The class is built from the schema at import
(`schema.view`); the type checker reads it as the generated `ModelConfigKeys`
(MaxText/config/views_generated.py) with the methods below."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Self

import jax
import jax.numpy as jnp

from MaxText.backend.hot_path import select_hot_path
from MaxText.config.schema import MODEL_KEYS, Config, View, view
from MaxText.layers import attention_ops
from MaxText.layers.kv_cache import select_decode_attention


def select_init_rng(name: str, platform: str) -> str:
  """`param_init_rng` for a platform: auto is JAX's threefry on CPU (the platform-independent
  values) and XLA's RngBitGenerator elsewhere (a TPU compiled threefry's per-array init program in
  20-30 s, rbg's flat draws in a few: benchmarks/RESULTS.md)."""
  if name == "auto":
    return "threefry2x32" if platform == "cpu" else "rbg"
  return name


if TYPE_CHECKING:   # the fields the type checker reads (MaxText/config/views_generated.py)
  from MaxText.config.views_generated import ModelConfigKeys

  class _Fields(ModelConfigKeys, View):
    pass
else:
  _Fields = object


class _Methods(_Fields):
  @classmethod
  def from_config(cls, cfg: Config) -> Self:
    mcfg = super().from_config(cfg)  # the schema view: every model key of `cfg`
    platform = jax.default_backend()
    return dataclasses.replace(mcfg, attention=attention_ops.select_attention(cfg.attention, platform),
                               hot_path=select_hot_path(cfg.hot_path, platform),
                               param_init_rng=select_init_rng(mcfg.param_init_rng, platform),
                               decode_attention=select_decode_attention(cfg.decode_attention,
                                                                        platform))

  @property
  def compute_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.dtype)

  @property
  def param_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.weight_dtype)


if TYPE_CHECKING:   # what runs is the class below, built from the schema
  class ModelConfig(_Methods):
    pass
else:
  ModelConfig = view("ModelConfig", MODEL_KEYS, __name__, bases=(_Methods,))
