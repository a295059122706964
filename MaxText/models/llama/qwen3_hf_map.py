"""Hugging Face Qwen3 (`model_type: qwen3`, `Qwen3ForCausalLM`) ↔ our `llama` family with
`use_qk_norm=true`: the Llama map (MaxText/models/llama/hf_map.py: rows, layouts, tied heads) plus
the per-head q/k RMSNorm scales.

  self_attn.q_norm.weight [E] ↔ attn/query_norm/scale [E]     k_norm ↔ attn/key_norm/scale

Numerics checked against transformers 5.24 (tests/test_qwen3_parity.py): RMSNorm normalises in fp32,
casts to the activation dtype, then multiplies by the weight; RoPE is rotate-half with fp32 angles,
cos/sin cast to the activation dtype and the rotation done in that dtype; `inv_freq` computed as
`1 / base**(2i/E)` — all as ours (layers/norms.py, layers/rope.py).
"""
from __future__ import annotations

from typing import Any, Mapping

from MaxText.models.llama import hf_map as llama
from MaxText.models.llama.model import Transformer, layer_location
from MaxText.models.name_map import NameMap, Rule, check_representable

GLOBAL_RULES = llama.GLOBAL_RULES
QK_NORM_RULES: tuple[Rule, ...] = (
    Rule("attn/query_norm/scale", "model.layers.{i}.self_attn.q_norm.weight"),
    Rule("attn/key_norm/scale", "model.layers.{i}.self_attn.k_norm.weight"),
)
ATTENTION_RULES = llama.ATTENTION_RULES + QK_NORM_RULES
LAYER_RULES = ATTENTION_RULES + llama.DENSE_MLP_RULES

IGNORED_SUFFIXES = llama.IGNORED_SUFFIXES
NAME_MAP = NameMap(GLOBAL_RULES, LAYER_RULES, layer_location, Transformer,
                   check=lambda mcfg: config_to_hf(mcfg), ignored_suffixes=IGNORED_SUFFIXES)
REPRESENTS = llama.REPRESENTS | {"use_qk_norm"}
# the tensor functions (see name_map.NameMap), each refusing a model Qwen3 cannot hold
hf_names, hf_to_params, params_to_hf = NAME_MAP.hf_names, NAME_MAP.hf_to_params, NAME_MAP.params_to_hf


# ---- config --------------------------------------------------------------------------------------
def dense_keys_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
  """The keys Qwen3 and Qwen3-MoE share: Llama's with `Qwen3Config`'s defaults (head_dim 128,
  32768 positions) and the q/k norm."""
  return {**llama.dense_keys_from_hf(hf, head_dim=128, max_positions=32768), "use_qk_norm": True}


def config_from_hf(hf_config: Mapping[str, Any]) -> dict[str, Any]:
  """HF Qwen3 config (config.json / `Qwen3Config.to_dict()`) → our config keys. Missing optional
  fields take `Qwen3Config`'s defaults (head_dim 128, K = H, untied, eps 1e-6, 32768 positions)."""
  hf = dict(hf_config)
  if hf.get("model_type", "qwen3") != "qwen3":
    raise ValueError(f"model_type={hf.get('model_type')!r}: this map is for 'qwen3'")
  return dense_keys_from_hf(hf)


def dense_keys_to_hf(get, model_type: str, architecture: str) -> dict[str, Any]:
  if not get("use_qk_norm"):
    raise ValueError(f"{model_type} needs use_qk_norm=true (hf_model_type llama has no q/k norm)")
  return {**llama.dense_keys_to_hf(get, model_type, architecture), "use_sliding_window": False}


def config_to_hf(cfg: Any) -> dict[str, Any]:
  """Our config (`Config`, `ModelConfig` or a dict of our keys) → HF Qwen3 config dict, usable as
  `transformers.Qwen3Config(**d)` or as config.json (θ is written in both the 5.x and 4.x places).
  ValueError when Qwen3 cannot hold the model."""
  get = llama.getter(cfg)
  if get("num_experts"):
    raise ValueError("num_experts > 0 is Qwen3-MoE (hf_model_type=qwen3_moe), not qwen3")
  if not isinstance(cfg, Mapping):
    check_representable(cfg, REPRESENTS, "qwen3")
  return dense_keys_to_hf(get, "qwen3", "Qwen3ForCausalLM")
