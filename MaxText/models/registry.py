"""`decoder_block` → model family. A family registers a constructor `(ModelConfig, rngs) -> Module`
whose instances are called as `model(tokens_BS, positions_BS, segment_ids_BS) -> logits_BSV`, plus a
config check run before anything compiles. Generic code only ever goes through this table."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from flax import nnx

from MaxText.models.model_config import ModelConfig


@dataclass(frozen=True)
class Family:
  build: Callable[[ModelConfig, nnx.Rngs], nnx.Module]
  validate: Callable[[ModelConfig], list[tuple[str, str]]]  # → [(key, problem)]


def _dense_checks(cfg: ModelConfig) -> list[tuple[str, str]]:
  problems = []
  if cfg.num_query_heads % cfg.num_kv_heads:
    problems.append(("num_kv_heads", f"num_query_heads={cfg.num_query_heads} is not a multiple "
                                      f"of num_kv_heads={cfg.num_kv_heads}"))
  if cfg.head_dim % 2:
    problems.append(("head_dim", f"head_dim={cfg.head_dim} must be even for RoPE"))
  return problems


def _llama(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
  from MaxText.models.llama.model import Transformer
  return Transformer(cfg, rngs=rngs)


FAMILIES: dict[str, Family] = {
    "llama": Family(build=_llama, validate=_dense_checks),
}


def get_family(decoder_block: str) -> Family:
  if decoder_block not in FAMILIES:
    from MaxText.config.load import ConfigError
    raise ConfigError(f"decoder_block='{decoder_block}': unknown model family "
                      f"(known: {', '.join(sorted(FAMILIES))})")
  return FAMILIES[decoder_block]


# Hugging Face model_type → the module holding that architecture's name map (`hf_to_params`,
# `params_to_hf`, `config_from_hf`, `config_to_hf`), imported only when a converter needs it.
HF_MAPS: dict[str, str] = {
    "qwen3": "MaxText.models.qwen3.hf_map",
}


def get_hf_map(model_type: str):
  import importlib
  if model_type not in HF_MAPS:
    raise ValueError(f"Hugging Face model_type '{model_type}' is not supported "
                     f"(supported: {', '.join(sorted(HF_MAPS))})")
  return importlib.import_module(HF_MAPS[model_type])
