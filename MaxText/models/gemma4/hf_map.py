"""Hugging Face Gemma 4 text (`gemma4_text`, `Gemma4ForCausalLM`; and the text model inside
multimodal `gemma4` checkpoints, prefix `model.language_model.`) ↔ our `gemma4` family.

Rows of the name map (layouts: `in_rank`, see MaxText/models/name_map.py):
  model.embed_tokens.weight [V, D]                 embedding [V, D]
  model.embed_tokens_per_layer.weight [Vp, L*P]    ple_embedding [Vp, L*P]   (layer-major columns)
  model.per_layer_model_projection.weight [L*P, D] ple_model_proj/kernel [D, L*P]
  model.layers.{i}.self_attn.q_proj [H*E, D]       attn/query/kernel [D, H, E]   (E per layer kind)
  k_proj / v_proj [K*E, D]                         attn/key|value/kernel [D, K, E]
  (kv-shared layers have no k/v/k_norm; full layers with attention_k_eq_v have no v_proj; v_norm
  has no weight)
  layer_scalar [1]                                 layer_scalar [1]   (a frozen buffer in HF)
Norm weights are plain `w` (Gemma 4 is not Gemma 1-3's `1 + w`) and copy as they are.

Hub checkpoints of KV-sharing models may still carry k/v projections and norms for the shared
layers; transformers ignores them on load, and so does `hf_to_params`. A multimodal checkpoint
read for a text model (a config without towers): the towers and their embedders are skipped (the
export writes a text-only `gemma4_text` model); with its towers it is gemma4_hf_map.py's. The additive MoE block (`enable_moe_block`, 26B-A4B):
  router.proj.weight [E, D] ↔ router/proj/kernel [D, E]; router.scale, router.per_expert_scale
  experts.gate_up_proj [E, 2F, D] ↔ experts/wi [E, D, 2F]; experts.down_proj [E, D, F] ↔ experts/wo
  pre_/post_feedforward_layernorm_2, post_feedforward_layernorm_1 ↔ mlp_norm_2, post_mlp_norm_2/_1
Our `router_bias` (aux-loss-free selection bias) has no HF counterpart: imported as zeros, and
exporting a non-zero one is refused.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from MaxText.models.gemma4.model import Transformer, layer_kinds, layer_location
from MaxText.models.model_config import ModelConfig
from MaxText.models.name_map import (CAUSAL_LM_RULES, FolderMap, NameMap, Rule,
                                     check_representable, self_attention_rules)

GLOBAL_RULES: tuple[Rule, ...] = (
    *CAUSAL_LM_RULES,
    Rule("ple_embedding", "model.embed_tokens_per_layer.weight"),
    Rule("ple_model_proj/kernel", "model.per_layer_model_projection.weight", in_rank=1),
    Rule("ple_proj_norm/scale", "model.per_layer_projection_norm.weight"),
)

_L = "model.layers.{i}."
LAYER_RULES: tuple[Rule, ...] = (
    Rule("attn_norm/scale", _L + "input_layernorm.weight"),
    Rule("post_attn_norm/scale", _L + "post_attention_layernorm.weight"),
    Rule("mlp_norm/scale", _L + "pre_feedforward_layernorm.weight"),
    Rule("post_mlp_norm/scale", _L + "post_feedforward_layernorm.weight"),
    *self_attention_rules(_L),
    Rule("attn/query_norm/scale", _L + "self_attn.q_norm.weight"),
    Rule("attn/key_norm/scale", _L + "self_attn.k_norm.weight"),
    Rule("mlp/gate/kernel", _L + "mlp.gate_proj.weight", in_rank=1),
    Rule("mlp/up/kernel", _L + "mlp.up_proj.weight", in_rank=1),
    Rule("mlp/down/kernel", _L + "mlp.down_proj.weight", in_rank=1),
    Rule("ple_gate/kernel", _L + "per_layer_input_gate.weight", in_rank=1),
    Rule("ple_proj/kernel", _L + "per_layer_projection.weight", in_rank=1),
    Rule("ple_norm/scale", _L + "post_per_layer_input_norm.weight"),
    Rule("layer_scalar", _L + "layer_scalar"),
    # the MoE block (26B-A4B): router, fused experts, the extra norms
    Rule("router/proj/kernel", _L + "router.proj.weight", in_rank=1),
    Rule("router/scale", _L + "router.scale"),
    Rule("router/per_expert_scale", _L + "router.per_expert_scale"),
    Rule("experts/wi", _L + "experts.gate_up_proj", in_rank=1, lead=1),
    Rule("experts/wo", _L + "experts.down_proj", in_rank=1, lead=1),
    Rule("mlp_norm_2/scale", _L + "pre_feedforward_layernorm_2.weight"),
    Rule("post_mlp_norm_1/scale", _L + "post_feedforward_layernorm_1.weight"),
    Rule("post_mlp_norm_2/scale", _L + "post_feedforward_layernorm_2.weight"),
)

NAME_MAP = NameMap(GLOBAL_RULES, LAYER_RULES, layer_location, Transformer,
                   ours_only=("router_bias",), check=lambda mcfg: config_to_hf(mcfg))
# the architecture keys a Gemma 4 config.json holds (any other one away from its default is refused)
REPRESENTS = frozenset({
    "vocab_size", "emb_dim", "num_decoder_layers", "num_query_heads", "num_kv_heads", "head_dim",
    "mlp_dim", "mlp_activation", "norm_epsilon", "use_qk_norm", "tie_word_embeddings",
    "rope_theta", "max_position_embeddings", "attention_pattern", "sliding_window",
    "attention_scale", "global_head_dim", "global_num_kv_heads", "global_rope_theta",
    "global_rope_fraction", "attention_k_eq_v", "num_kv_shared_layers",
    "double_wide_mlp_on_shared", "per_layer_input_dim", "per_layer_input_vocab_size",
    "final_logit_softcap", "num_experts", "num_experts_per_tok", "moe_mlp_dim", "norm_topk_prob"})
MULTIMODAL_PREFIX = "model.language_model."
_SHARED_KV = re.compile(r"model\.layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.weight$")


class _TextView(Mapping):
  """A multimodal checkpoint's text tensors under their `gemma4_text` names."""

  def __init__(self, hf_state: Mapping[str, Any]):
    self._state = hf_state
    self._names = {"model." + k[len(MULTIMODAL_PREFIX):]: k for k in hf_state
                   if k.startswith(MULTIMODAL_PREFIX)}

  def __getitem__(self, name: str):
    return self._state[self._names[name]]

  def __iter__(self):
    return iter(self._names)

  def __len__(self) -> int:
    return len(self._names)


hf_names, params_to_hf = NAME_MAP.hf_names, NAME_MAP.params_to_hf


def shared_kv(mcfg: ModelConfig) -> Callable[[str], bool]:
  """Whether a (`gemma4_text`) name is K/V of a kv-shared layer: hub checkpoints may carry them;
  transformers ignores them, and so do we."""
  shared = {i for i, k in enumerate(layer_kinds(mcfg)) if k.kv_shared}

  def ignore(name: str) -> bool:
    m = _SHARED_KV.match(name)
    return bool(m) and int(m.group(1)) in shared
  return ignore


def _is_multimodal(names: Iterable[str]) -> bool:
  return any(k.startswith(MULTIMODAL_PREFIX) for k in names)


def hf_to_params(hf_state: Mapping[str, np.ndarray], mcfg: ModelConfig) -> dict:
  """HF tensors (`gemma4_text` names, or a multimodal checkpoint's) → our pure-dict params."""
  if _is_multimodal(hf_state):
    hf_state = _TextView(hf_state)
  return NAME_MAP.hf_to_params(hf_state, mcfg, ignore=shared_kv(mcfg))


def folder_map(names: Iterable[str], mcfg: ModelConfig) -> FolderMap:
  """What `hf_to_params` reads of a folder holding tensors `names`, a box at a time: a
  multimodal folder's text tensors under their `gemma4_text` names (everything else unseen)."""
  skip = shared_kv(mcfg)
  if not _is_multimodal(names):
    return FolderMap(NAME_MAP, ignore=skip)
  n = len(MULTIMODAL_PREFIX)
  return FolderMap(
      NAME_MAP,
      rename=lambda name: MULTIMODAL_PREFIX + name[len("model."):] if name.startswith("model.")
      else name,
      ignore=lambda name: not name.startswith(MULTIMODAL_PREFIX) or skip("model." + name[n:]))


# ---- config --------------------------------------------------------------------------------------
_KINDS = {"sliding_attention": "s", "full_attention": "f"}


def _compress(letters: str) -> str:
  """The shortest pattern whose repetition gives `letters` (our `attention_pattern`)."""
  n = len(letters)
  for p in range(1, n + 1):
    if n % p == 0 and letters[:p] * (n // p) == letters:
      return letters[:p]
  return letters


def _text_config(hf: Mapping[str, Any]) -> dict[str, Any]:
  model_type = hf.get("model_type", "gemma4_text")
  if model_type == "gemma4":
    if "text_config" not in hf:
      raise ValueError("model_type='gemma4' config has no text_config")
    return dict(hf["text_config"])
  if model_type != "gemma4_text":
    raise ValueError(f"model_type={model_type!r}: this map is for 'gemma4_text' / 'gemma4'")
  return dict(hf)


def config_from_hf(hf_config: Mapping[str, Any]) -> dict[str, Any]:
  """HF Gemma 4 config (config.json or `to_dict()`; multimodal: its text_config) → our keys."""
  hf = _text_config(hf_config)
  if hf.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
    raise ValueError(f"hidden_activation={hf['hidden_activation']!r}: only gelu_pytorch_tanh")
  if hf.get("attention_bias"):
    raise ValueError("attention_bias=true is not supported (our projections have no bias)")
  if hf.get("use_bidirectional_attention"):
    raise ValueError(f"use_bidirectional_attention={hf['use_bidirectional_attention']!r} is not "
                     f"supported (causal language models only)")
  L = int(hf["num_hidden_layers"])
  types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention"
                                    for i in range(L)]
  if len(types) != L or set(types) - set(_KINDS):
    raise ValueError(f"layer_types must list {L} of {sorted(_KINDS)}, got {types}")
  types = [*types[:-1], "full_attention"]  # transformers forces the last layer full
  letters = "".join(_KINDS[t] for t in types)
  rope = dict(hf.get("rope_parameters") or {})
  sliding = dict(rope.get("sliding_attention") or {"rope_type": "default", "rope_theta": 1e4})
  full = dict(rope.get("full_attention") or {"rope_type": "proportional",
                                             "partial_rotary_factor": 0.25, "rope_theta": 1e6})
  if sliding.get("rope_type", "default") != "default" or sliding.get("partial_rotary_factor",
                                                                     1.0) != 1.0:
    raise ValueError(f"sliding-layer RoPE {sliding} is not supported (only default, full rotary)")
  if full.get("rope_type") not in ("proportional", "default"):
    raise ValueError(f"full-layer RoPE type {full.get('rope_type')!r} is not supported")
  full_fraction = float(full.get("partial_rotary_factor", 1.0)) if full.get(
      "rope_type") == "proportional" else 1.0
  head_dim, kv_heads = int(hf.get("head_dim", 256)), int(hf.get("num_key_value_heads", 4))
  k_eq_v = bool(hf.get("attention_k_eq_v", False))
  global_head_dim, global_kv = _global_dims(hf, types, head_dim, kv_heads, k_eq_v)
  P = int(hf.get("hidden_size_per_layer_input", 256) or 0)
  softcap = hf.get("final_logit_softcapping")
  return {
      "decoder_block": "gemma4",
      "hf_model_type": "gemma4_text",
      "vocab_size": int(hf.get("vocab_size", 262144)),
      "emb_dim": int(hf["hidden_size"]),
      "num_decoder_layers": L,
      "num_query_heads": int(hf["num_attention_heads"]),
      "num_kv_heads": kv_heads,
      "head_dim": head_dim,
      "mlp_dim": int(hf["intermediate_size"]),
      "mlp_activation": "gelu_tanh",
      "norm_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
      "use_qk_norm": True,
      "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
      "rope_theta": float(sliding.get("rope_theta", 1e4)),
      "max_position_embeddings": int(hf.get("max_position_embeddings", 131072)),
      "attention_pattern": _compress(letters),
      "sliding_window": int(hf.get("sliding_window", 512)) if "s" in letters else 0,
      "attention_scale": 1.0,
      "global_head_dim": global_head_dim,
      "global_num_kv_heads": global_kv,
      "global_rope_theta": float(full.get("rope_theta", 1e6)),
      "global_rope_fraction": full_fraction,
      "attention_k_eq_v": k_eq_v,
      "num_kv_shared_layers": int(hf.get("num_kv_shared_layers", 0) or 0),
      "double_wide_mlp_on_shared": bool(hf.get("use_double_wide_mlp", False)),
      "per_layer_input_dim": P,
      "per_layer_input_vocab_size": int(hf.get("vocab_size_per_layer_input", 262144)) if P else 0,
      "final_logit_softcap": float(softcap) if softcap else 0.0,
      **_moe_keys(hf),
  }


def _moe_keys(hf: Mapping[str, Any]) -> dict[str, Any]:
  if not hf.get("enable_moe_block"):
    return {"num_experts": 0, "moe_mlp_dim": 0}
  missing = [k for k in ("num_experts", "top_k_experts", "moe_intermediate_size") if not hf.get(k)]
  if missing:
    raise ValueError(f"enable_moe_block=true but {missing} not set")
  return {"num_experts": int(hf["num_experts"]), "num_experts_per_tok": int(hf["top_k_experts"]),
          "moe_mlp_dim": int(hf["moe_intermediate_size"]), "norm_topk_prob": True}


def _global_dims(hf: Mapping[str, Any], types: list[str], head_dim: int, kv_heads: int,
                 k_eq_v: bool) -> tuple[int, int]:
  """(global_head_dim, global_num_kv_heads) from the hub form (`global_head_dim`,
  `num_global_key_value_heads`, the latter only with attention_k_eq_v) or from `per_layer_config`
  (what save_pretrained writes: per-layer head_dim / num_key_value_heads overrides)."""
  if "per_layer_config" in hf and hf["per_layer_config"] is not None:
    overrides = {int(i): dict(v) for i, v in dict(hf["per_layer_config"]).items()}
    seen = {}
    for i, t in enumerate(types):
      o = overrides.get(i, {})
      unknown = set(o) - {"head_dim", "num_key_value_heads"}
      if unknown:
        raise ValueError(f"per_layer_config[{i}] sets {sorted(unknown)}: not supported")
      dims = (int(o.get("head_dim", head_dim)), int(o.get("num_key_value_heads", kv_heads)))
      if t == "sliding_attention" and dims != (head_dim, kv_heads):
        raise ValueError(f"per_layer_config[{i}] changes a sliding layer: not supported")
      if seen.setdefault(t, dims) != dims:
        raise ValueError(f"per_layer_config gives full layers different shapes: {seen[t]} vs {dims}")
    g_hd, g_kv = seen.get("full_attention", (head_dim, kv_heads))
  else:
    g_hd = int(hf.get("global_head_dim", 512))
    g_kv = int(hf.get("num_global_key_value_heads") or kv_heads) if k_eq_v else kv_heads
  return (0 if g_hd == head_dim else g_hd), (0 if g_kv == kv_heads else g_kv)


def config_to_hf(cfg: Any) -> dict[str, Any]:
  """Our config (`Config`, `ModelConfig` or a dict of our keys) → HF `gemma4_text` config dict,
  usable as config.json or `transformers.Gemma4TextConfig(**d)`."""
  get = cfg.__getitem__ if isinstance(cfg, Mapping) else lambda k: getattr(cfg, k)
  if get("decoder_block") != "gemma4" or get("mlp_activation") != "gelu_tanh":
    raise ValueError("Gemma 4 needs decoder_block=gemma4, mlp_activation=gelu_tanh")
  if not isinstance(cfg, Mapping):
    check_representable(cfg, REPRESENTS, "gemma4_text")
  if float(get("attention_scale")) != 1.0:
    raise ValueError(f"attention_scale={get('attention_scale')}: Gemma 4 uses 1.0")
  L, pattern = int(get("num_decoder_layers")), get("attention_pattern") or "f"
  types = ["sliding_attention" if pattern[i % len(pattern)] == "s" else "full_attention"
           for i in range(L)]
  head_dim, kv_heads = int(get("head_dim")), int(get("num_kv_heads"))
  full = {"head_dim": int(get("global_head_dim")) or head_dim,
          "num_key_value_heads": int(get("global_num_kv_heads")) or kv_heads}
  P = int(get("per_layer_input_dim"))
  softcap = float(get("final_logit_softcap"))
  return {
      "architectures": ["Gemma4ForCausalLM"],
      "model_type": "gemma4_text",
      "vocab_size": int(get("vocab_size")),
      "hidden_size": int(get("emb_dim")),
      "intermediate_size": int(get("mlp_dim")),
      "num_hidden_layers": L,
      "num_attention_heads": int(get("num_query_heads")),
      "num_key_value_heads": kv_heads,
      "head_dim": head_dim,
      "hidden_activation": "gelu_pytorch_tanh",
      "rms_norm_eps": float(get("norm_epsilon")),
      "max_position_embeddings": int(get("max_position_embeddings")),
      "tie_word_embeddings": bool(get("tie_word_embeddings")),
      "layer_types": types,
      "sliding_window": int(get("sliding_window")) or 512,
      "rope_parameters": {
          "sliding_attention": {"rope_type": "default", "rope_theta": float(get("rope_theta"))},
          "full_attention": {"rope_type": "proportional",
                             "partial_rotary_factor": float(get("global_rope_fraction")),
                             "rope_theta": float(get("global_rope_theta") or get("rope_theta"))},
      },
      "per_layer_config": {str(i): dict(full) for i, t in enumerate(types) if t == "full_attention"},
      "attention_k_eq_v": bool(get("attention_k_eq_v")),
      "num_kv_shared_layers": int(get("num_kv_shared_layers")),
      "use_double_wide_mlp": bool(get("double_wide_mlp_on_shared")),
      "hidden_size_per_layer_input": P,
      "vocab_size_per_layer_input": (int(get("per_layer_input_vocab_size"))
                                     or int(get("vocab_size"))),
      "final_logit_softcapping": softcap if softcap else None,
      "attention_bias": False,
      "use_bidirectional_attention": None,
      "enable_moe_block": bool(get("num_experts")),
      **({"num_experts": int(get("num_experts")), "top_k_experts": int(get("num_experts_per_tok")),
          "moe_intermediate_size": int(get("moe_mlp_dim"))} if get("num_experts") else {}),
  }
