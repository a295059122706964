"""Hugging Face Qwen3 (`model_type: qwen3`, `Qwen3ForCausalLM`) ↔ our `llama` family.

The name map is data (`GLOBAL_RULES`, `LAYER_RULES`): one row per parameter, read in both
directions by `hf_to_params` / `params_to_hf` (MaxText/checkpoint_conversion/name_map.py). Config
keys map through `config_from_hf` / `config_to_hf`.

Layouts (`in_rank`, see name_map.py):
  q_proj [H*E, D] ↔ attn/query/kernel [D, H, E]      o_proj [D, H*E] ↔ attn/out/kernel [H, E, D]
  k_proj, v_proj [K*E, D] ↔ [D, K, E]                 gate/up_proj [F, D] ↔ [D, F]; down [D, F] ↔ [F, D]
  lm_head [V, D] ↔ lm_head/kernel [D, V]             embed_tokens [V, D] = embedding [V, D]
Norm scales are copied as they are (Qwen3 RMSNorm is plain `w`, init 1 — same as ours).
Per-layer rows name `model.layers.{i}.…`; with `scan_layers=true` our parameter carries a leading
`[L]` axis (the HF tensors of layers 0..L-1 stacked), otherwise it lives at `decoder/layers/<i>/…`.

Tied embeddings: our params have no `lm_head`; HF's `state_dict()` still lists `lm_head.weight`
(the same tensor as `model.embed_tokens.weight`) while `save_pretrained` drops it. `hf_to_params`
accepts it when it equals the embedding; `params_to_hf(..., tied_lm_head=True)` writes it.

Numerics checked against transformers 5.24 (tests/test_qwen3_parity.py): RMSNorm normalises in fp32,
casts to the activation dtype, then multiplies by the weight; RoPE is rotate-half with fp32 angles,
cos/sin cast to the activation dtype and the rotation done in that dtype; `inv_freq` computed as
`1 / base**(2i/E)` — all as ours (layers/norms.py, layers/rope.py).
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from MaxText.checkpoint_conversion.name_map import NameMap, Rule
from MaxText.models.llama.model import layer_location
from MaxText.models.model_config import ModelConfig

GLOBAL_RULES: tuple[Rule, ...] = (
    Rule("embedding", "model.embed_tokens.weight"),
    Rule("final_norm/scale", "model.norm.weight"),
    Rule("lm_head/kernel", "lm_head.weight", in_rank=1),
)

LAYER_RULES: tuple[Rule, ...] = (
    Rule("attn_norm/scale", "model.layers.{i}.input_layernorm.weight"),
    Rule("attn/query/kernel", "model.layers.{i}.self_attn.q_proj.weight", in_rank=1),
    Rule("attn/key/kernel", "model.layers.{i}.self_attn.k_proj.weight", in_rank=1),
    Rule("attn/value/kernel", "model.layers.{i}.self_attn.v_proj.weight", in_rank=1),
    Rule("attn/out/kernel", "model.layers.{i}.self_attn.o_proj.weight", in_rank=2),
    Rule("attn/query_norm/scale", "model.layers.{i}.self_attn.q_norm.weight"),
    Rule("attn/key_norm/scale", "model.layers.{i}.self_attn.k_norm.weight"),
    Rule("mlp_norm/scale", "model.layers.{i}.post_attention_layernorm.weight"),
    Rule("mlp/gate/kernel", "model.layers.{i}.mlp.gate_proj.weight", in_rank=1),
    Rule("mlp/up/kernel", "model.layers.{i}.mlp.up_proj.weight", in_rank=1),
    Rule("mlp/down/kernel", "model.layers.{i}.mlp.down_proj.weight", in_rank=1),
)

NAME_MAP = NameMap(GLOBAL_RULES, LAYER_RULES, layer_location)
# Non-parameter buffers older checkpoints may carry.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _check(mcfg: ModelConfig) -> None:
  if mcfg.decoder_block != "llama":
    raise ValueError(f"Qwen3 maps onto decoder_block=llama, not {mcfg.decoder_block!r}")


def hf_names(mcfg: ModelConfig, *, tied_lm_head: bool = False) -> list[str]:
  """Every HF tensor name the model of `mcfg` maps to."""
  _check(mcfg)
  return NAME_MAP.hf_names(mcfg, tied_lm_head=tied_lm_head)


def hf_to_params(hf_state: Mapping[str, np.ndarray], mcfg: ModelConfig) -> dict:
  """HF state dict (NumPy arrays, possibly a lazy mapping) → our pure-dict params."""
  _check(mcfg)
  return NAME_MAP.hf_to_params(hf_state, mcfg, ignore=lambda k: k.endswith(IGNORED_SUFFIXES))


def params_to_hf(params: Mapping, mcfg: ModelConfig, *, tied_lm_head: bool = False
                 ) -> Mapping[str, np.ndarray]:
  """Our params → HF tensors (lazy; `lm_head.weight` only when untied or `tied_lm_head`)."""
  _check(mcfg)
  return NAME_MAP.params_to_hf(params, mcfg, tied_lm_head=tied_lm_head)


# ---- config --------------------------------------------------------------------------------------
def _rope_theta(hf: Mapping[str, Any]) -> float:
  """transformers 5 keeps θ in `rope_parameters`; 4.x configs have top-level `rope_theta` and
  `rope_scaling`. Only plain (unscaled, full-rotary) RoPE is supported."""
  rope = dict(hf.get("rope_parameters") or {})
  for src in (rope, dict(hf.get("rope_scaling") or {})):
    kind = src.get("rope_type", src.get("type", "default"))
    if kind != "default":
      raise ValueError(f"rope type {kind!r} is not supported (only default RoPE)")
  partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
  if partial not in (None, 1, 1.0):
    raise ValueError(f"partial_rotary_factor={partial} is not supported")
  theta = rope.get("rope_theta", hf.get("rope_theta"))
  return float(10000.0 if theta is None else theta)  # Qwen3Config's default θ


def config_from_hf(hf_config: Mapping[str, Any]) -> dict[str, Any]:
  """HF Qwen3 config (config.json / `Qwen3Config.to_dict()`) → our config keys. Missing optional
  fields take `Qwen3Config`'s defaults (head_dim 128, K = H, untied, eps 1e-6, 32768 positions)."""
  hf = dict(hf_config)
  if hf.get("model_type", "qwen3") != "qwen3":
    raise ValueError(f"model_type={hf.get('model_type')!r}: this map is for 'qwen3'")
  return dense_keys_from_hf(hf)


def dense_keys_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
  """The keys Qwen3 and Qwen3-MoE share (attention, norms, embeddings, RoPE)."""
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"hidden_act={hf['hidden_act']!r}: only silu is supported")
  if hf.get("attention_bias", False):
    raise ValueError("attention_bias=true is not supported (our projections have no bias)")
  if hf.get("use_sliding_window", False):
    raise ValueError("use_sliding_window=true is not supported")
  H = int(hf["num_attention_heads"])
  return {
      "decoder_block": "llama",
      "vocab_size": int(hf["vocab_size"]),
      "emb_dim": int(hf["hidden_size"]),
      "num_decoder_layers": int(hf["num_hidden_layers"]),
      "num_query_heads": H,
      "num_kv_heads": int(hf.get("num_key_value_heads") or H),
      "head_dim": int(hf.get("head_dim") or 128),
      "mlp_dim": int(hf["intermediate_size"]),
      "mlp_activation": "silu",
      "norm_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
      "use_qk_norm": True,
      "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
      "rope_theta": _rope_theta(hf),
      "max_position_embeddings": int(hf.get("max_position_embeddings", 32768)),
  }


def config_to_hf(cfg: Any) -> dict[str, Any]:
  """Our config (`Config`, `ModelConfig` or a dict of our keys) → HF Qwen3 config dict, usable as
  `transformers.Qwen3Config(**d)` or as config.json (θ is written in both the 5.x and 4.x places)."""
  get = cfg.__getitem__ if isinstance(cfg, Mapping) else lambda k: getattr(cfg, k)
  if get("num_experts"):
    raise ValueError("num_experts > 0 is Qwen3-MoE (hf_model_type=qwen3_moe), not qwen3")
  return dense_keys_to_hf(get, "qwen3", "Qwen3ForCausalLM")


def dense_keys_to_hf(get, model_type: str, architecture: str) -> dict[str, Any]:
  if get("decoder_block") != "llama" or not get("use_qk_norm") or get("mlp_activation") != "silu":
    raise ValueError("Qwen3 needs decoder_block=llama, use_qk_norm=true, mlp_activation=silu")
  theta = float(get("rope_theta"))
  return {
      "architectures": [architecture],
      "model_type": model_type,
      "vocab_size": int(get("vocab_size")),
      "hidden_size": int(get("emb_dim")),
      "intermediate_size": int(get("mlp_dim")),
      "num_hidden_layers": int(get("num_decoder_layers")),
      "num_attention_heads": int(get("num_query_heads")),
      "num_key_value_heads": int(get("num_kv_heads")),
      "head_dim": int(get("head_dim")),
      "hidden_act": "silu",
      "rms_norm_eps": float(get("norm_epsilon")),
      "max_position_embeddings": int(get("max_position_embeddings")),
      "tie_word_embeddings": bool(get("tie_word_embeddings")),
      "rope_parameters": {"rope_type": "default", "rope_theta": theta},
      "rope_theta": theta,
      "attention_bias": False,
      "use_sliding_window": False,
  }
