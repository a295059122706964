"""Hugging Face Llama (`model_type: llama`, `LlamaForCausalLM`) ↔ our `llama` family — the default
model of configs/base.yml is one. Qwen3 (MaxText/models/llama/qwen3_hf_map.py) and Qwen3-MoE extend these
rows and config keys.

The name map is data (`GLOBAL_RULES`, `LAYER_RULES`): one row per parameter, read in both
directions by `hf_to_params` / `params_to_hf` (MaxText/models/name_map.py). Config keys map
through `config_from_hf` / `config_to_hf`.

Layouts (`in_rank`, see name_map.py):
  q_proj [H*E, D] ↔ attn/query/kernel [D, H, E]      o_proj [D, H*E] ↔ attn/out/kernel [H, E, D]
  k_proj, v_proj [K*E, D] ↔ [D, K, E]                 gate/up_proj [F, D] ↔ [D, F]; down [D, F] ↔ [F, D]
  lm_head [V, D] ↔ lm_head/kernel [D, V]             embed_tokens [V, D] = embedding [V, D]
Norm scales are copied as they are (Llama's RMSNorm is plain `w`, init 1, normalised in fp32,
cast to the activation dtype, then scaled — as ours). Per-layer rows name `model.layers.{i}.…`;
where layer i lives in our params comes from the pattern stack (`model.layer_location`).

Tied embeddings: our params have no `lm_head`; HF's `state_dict()` still lists `lm_head.weight`
(the same tensor as `model.embed_tokens.weight`) while `save_pretrained` drops it. `hf_to_params`
accepts it when it equals the embedding; `params_to_hf(..., tied_lm_head=True)` writes it.
Only plain RoPE is supported (a `rope_scaling` such as Llama 3's `llama3` type is refused), no
attention or MLP biases, `pretraining_tp` 1.
"""
from __future__ import annotations

from typing import Any, Mapping

from MaxText.models.llama.model import Transformer, layer_location
from MaxText.models.name_map import (CAUSAL_LM_RULES, NameMap, Rule, check_representable,
                                     self_attention_rules)

GLOBAL_RULES = CAUSAL_LM_RULES

_L = "model.layers.{i}."
ATTENTION_RULES: tuple[Rule, ...] = (
    Rule("attn_norm/scale", _L + "input_layernorm.weight"),
    *self_attention_rules(_L),
    Rule("mlp_norm/scale", _L + "post_attention_layernorm.weight"),
)
DENSE_MLP_RULES: tuple[Rule, ...] = (
    Rule("mlp/gate/kernel", _L + "mlp.gate_proj.weight", in_rank=1),
    Rule("mlp/up/kernel", _L + "mlp.up_proj.weight", in_rank=1),
    Rule("mlp/down/kernel", _L + "mlp.down_proj.weight", in_rank=1),
)

# Non-parameter buffers older checkpoints may carry.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
NAME_MAP = NameMap(GLOBAL_RULES, ATTENTION_RULES + DENSE_MLP_RULES, layer_location, Transformer,
                   check=lambda mcfg: config_to_hf(mcfg), ignored_suffixes=IGNORED_SUFFIXES)
# the architecture keys a Llama config.json holds (any other one away from its default is refused)
REPRESENTS = frozenset({"vocab_size", "emb_dim", "num_decoder_layers", "num_query_heads",
                        "num_kv_heads", "head_dim", "mlp_dim", "mlp_activation", "norm_epsilon",
                        "tie_word_embeddings", "rope_theta", "max_position_embeddings"})
# the tensor functions (see name_map.NameMap): hf_names(mcfg), hf_to_params(hf_state, mcfg),
# params_to_hf(params, mcfg, tied_lm_head=False) — each refuses a model Llama cannot hold
hf_names, hf_to_params, params_to_hf = NAME_MAP.hf_names, NAME_MAP.hf_to_params, NAME_MAP.params_to_hf


# ---- config --------------------------------------------------------------------------------------
def rope_theta(hf: Mapping[str, Any], default: float) -> float:
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
  return float(default if theta is None else theta)


def dense_keys_from_hf(hf: Mapping[str, Any], *, head_dim: int, max_positions: int) -> dict:
  """The keys Llama, Qwen3 and Qwen3-MoE share (attention, norms, embeddings, RoPE, dense MLP);
  `head_dim` and `max_positions` are the config class's defaults for missing fields."""
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"hidden_act={hf['hidden_act']!r}: only silu is supported")
  if hf.get("attention_bias", False) or hf.get("mlp_bias", False):
    raise ValueError("attention_bias / mlp_bias = true is not supported (our projections have no "
                     "bias)")
  if hf.get("use_sliding_window", False):
    raise ValueError("use_sliding_window=true is not supported")
  if (hf.get("pretraining_tp") or 1) != 1:
    raise ValueError(f"pretraining_tp={hf['pretraining_tp']} is not supported (only 1)")
  H = int(hf["num_attention_heads"])
  return {
      "decoder_block": "llama",
      "vocab_size": int(hf["vocab_size"]),
      "emb_dim": int(hf["hidden_size"]),
      "num_decoder_layers": int(hf["num_hidden_layers"]),
      "num_query_heads": H,
      "num_kv_heads": int(hf.get("num_key_value_heads") or H),
      "head_dim": int(hf.get("head_dim") or head_dim),
      "mlp_dim": int(hf["intermediate_size"]),
      "mlp_activation": "silu",
      "norm_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
      "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
      "rope_theta": rope_theta(hf, 10000.0),
      "max_position_embeddings": int(hf.get("max_position_embeddings", max_positions)),
  }


def config_from_hf(hf_config: Mapping[str, Any]) -> dict[str, Any]:
  """HF Llama config (config.json / `LlamaConfig.to_dict()`) → our config keys. Missing optional
  fields take `LlamaConfig`'s defaults (head_dim D/H, K = H, untied, eps 1e-6, 2048 positions)."""
  hf = dict(hf_config)
  if hf.get("model_type", "llama") != "llama":
    raise ValueError(f"model_type={hf.get('model_type')!r}: this map is for 'llama'")
  keys = dense_keys_from_hf(hf, head_dim=int(hf["hidden_size"]) // int(hf["num_attention_heads"]),
                            max_positions=2048)
  return {**keys, "hf_model_type": "llama", "use_qk_norm": False}


def dense_keys_to_hf(get, model_type: str, architecture: str) -> dict[str, Any]:
  if get("decoder_block") != "llama" or get("mlp_activation") != "silu":
    raise ValueError(f"{model_type} needs decoder_block=llama and mlp_activation=silu")
  return causal_lm_keys_to_hf(get, model_type, architecture)


def causal_lm_keys_to_hf(get, model_type: str, architecture: str) -> dict[str, Any]:
  """The config.json fields the Llama lineage shares (sizes, norm eps, positions, tied head, plain
  RoPE θ in the 5.x and 4.x places, no attention bias)."""
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
  }


def getter(cfg: Any):
  """`cfg[k]` for a dict of our keys, `cfg.k` for a `Config` or `ModelConfig`."""
  return cfg.__getitem__ if isinstance(cfg, Mapping) else lambda k: getattr(cfg, k)


def config_to_hf(cfg: Any) -> dict[str, Any]:
  """Our config (`Config`, `ModelConfig` or a dict of our keys) → HF Llama config dict, usable as
  `transformers.LlamaConfig(**d)` or as config.json (θ is written in both the 5.x and 4.x places).
  ValueError when Llama cannot hold the model."""
  get = getter(cfg)
  if get("use_qk_norm") or get("num_experts"):
    raise ValueError("use_qk_norm / num_experts: Llama has neither (hf_model_type qwen3 or "
                     "qwen3_moe has)")
  if not isinstance(cfg, Mapping):
    check_representable(cfg, REPRESENTS, "llama")
  if int(get("emb_dim")) % int(get("num_query_heads")):
    raise ValueError(f"emb_dim={get('emb_dim')} is not a multiple of num_query_heads="
                     f"{get('num_query_heads')} (transformers' LlamaConfig requires it)")
  return {**dense_keys_to_hf(get, "llama", "LlamaForCausalLM"), "mlp_bias": False,
          "pretraining_tp": 1}
