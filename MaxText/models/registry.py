"""`decoder_block` → model family. A family registers a constructor `(ModelConfig, rngs) -> Module`
whose instances are called as `model(tokens_BS, positions_BS, segment_ids_BS) -> logits_BSV` and
`model.forward_with_aux(...) -> (logits_BSV, aux dict)` (MoE statistics), plus a config check run
before anything compiles. Generic code only ever goes through this table."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from flax import nnx

from MaxText.models.model_config import ModelConfig


@dataclass(frozen=True)
class Family:
  build: Callable[[ModelConfig, nnx.Rngs], nnx.Module]
  validate: Callable[[ModelConfig], list[tuple[str, str]]]  # → [(key, problem)]
  moe_adds_to_dense_mlp: bool = False   # with num_experts > 0: experts beside the MLP, not instead


# Keys for per-layer attention variants and their "off" values; a family that does not implement
# one refuses a config that turns it on.
VARIANT_KEYS_OFF = {
    "attention_pattern": "", "sliding_window": 0, "attention_scale": 0.0, "global_head_dim": 0,
    "global_num_kv_heads": 0, "global_rope_theta": 0.0, "global_rope_fraction": 1.0,
    "attention_k_eq_v": False, "num_kv_shared_layers": 0, "double_wide_mlp_on_shared": False,
    "per_layer_input_dim": 0, "per_layer_input_vocab_size": 0, "final_logit_softcap": 0.0,
}


def unsupported(cfg: ModelConfig, off: dict) -> list[tuple[str, str]]:
  """A family's refusal of the keys it does not implement ({key: its "off" value})."""
  return [(k, f"{k}={getattr(cfg, k)!r} is not supported by decoder_block={cfg.decoder_block}")
          for k in off if getattr(cfg, k) != off[k]]


def moe_checks(cfg: ModelConfig) -> list[tuple[str, str]]:
  if not cfg.num_experts:
    return []
  problems = []
  if cfg.moe_mlp_dim < 1:
    problems.append(("moe_mlp_dim", "num_experts > 0 needs moe_mlp_dim >= 1"))
  if cfg.num_experts_per_tok > cfg.num_experts:
    problems.append(("num_experts_per_tok", f"{cfg.num_experts_per_tok} experts per token out of "
                                            f"num_experts={cfg.num_experts}"))
  return problems


def _dense_checks(cfg: ModelConfig) -> list[tuple[str, str]]:
  problems = unsupported(cfg, VARIANT_KEYS_OFF) + moe_checks(cfg)
  if cfg.num_query_heads % cfg.num_kv_heads:
    problems.append(("num_kv_heads", f"num_query_heads={cfg.num_query_heads} is not a multiple "
                                      f"of num_kv_heads={cfg.num_kv_heads}"))
  if cfg.head_dim % 2:
    problems.append(("head_dim", f"head_dim={cfg.head_dim} must be even for RoPE"))
  return problems


def _llama(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
  from MaxText.models.llama.model import Transformer
  return Transformer(cfg, rngs=rngs)


def _gemma4(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
  from MaxText.models.gemma4.model import Transformer
  return Transformer(cfg, rngs=rngs)


def _gemma4_checks(cfg: ModelConfig) -> list[tuple[str, str]]:
  from MaxText.models.gemma4.model import validate
  return validate(cfg) + moe_checks(cfg)


FAMILIES: dict[str, Family] = {
    "llama": Family(build=_llama, validate=_dense_checks),
    "gemma4": Family(build=_gemma4, validate=_gemma4_checks, moe_adds_to_dense_mlp=True),
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
    "qwen3_moe": "MaxText.models.qwen3_moe.hf_map",
    "gemma4_text": "MaxText.models.gemma4.hf_map",
    "gemma4": "MaxText.models.gemma4.hf_map",     # multimodal checkpoints: the text model only
}


def get_hf_map(model_type: str):
  import importlib
  if model_type not in HF_MAPS:
    raise ValueError(f"Hugging Face model_type '{model_type}' is not supported "
                     f"(supported: {', '.join(sorted(HF_MAPS))})")
  return importlib.import_module(HF_MAPS[model_type])
