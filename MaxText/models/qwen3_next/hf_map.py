"""Hugging Face Qwen3-Next (`model_type: qwen3_next`, `Qwen3NextForCausalLM`) ↔ our `qwen3_next`
family (MaxText/models/qwen3_next/model.py).

Rows (layouts: `in_rank`, see MaxText/models/name_map.py); per layer `model.layers.{i}.`:
  input_layernorm / post_attention_layernorm      input_norm / post_attention_norm (1 + w: copied)
  full layers  self_attn.q_proj [H·2E, D]         attn/query/kernel [D, H, 2E] (per head q | gate)
               k_proj, v_proj, o_proj, q_norm, k_norm as Qwen3's
  linear layers linear_attn.in_proj_qkvz [Hk·(2Dk+2G·Dv), D] → linear_attn/in_proj_qkvz/kernel
               [D, Hk, 2Dk+2G·Dv] (the checkpoint already groups q|k|v|z per key head);
               in_proj_ba likewise; A_log, dt_bias, norm.weight as they are; out_proj [D, Hv·Dv]
               → [Hv, Dv, D]; conv1d.weight [Cq+Ck+Cv, 1, W] (channels: all q | all k | all v)
               ↔ linear_attn/conv [W, Hk, X] (per key head q | k | v: the channels regrouped)
  MoE layers   mlp.gate, experts (the hub's per-expert files or transformers' fused form, as
               Qwen3-MoE), mlp.shared_expert.{gate,up,down}_proj ↔ mlp/shared/...,
               mlp.shared_expert_gate [1, D] ↔ mlp/shared_gate/kernel [D, 1]
  dense layers mlp.{gate,up,down}_proj
Multi-token prediction (`mtp.*`: released checkpoints carry it, transformers ignores it): with
mtp_num_layers > 0, mtp.fc [D, 2D] ↔ mtp/fc/kernel [2D, D], mtp.pre_fc_norm_embedding,
mtp.pre_fc_norm_hidden, mtp.norm, and mtp.layers.{j}.* (a full-attention layer, names as a
decoder layer's) ↔ mtp/layers/{j}/...; every tensor round-trips bitwise. config.json does not say
how many MTP layers a checkpoint has: `config_from_tensor_names` counts them from its tensors.
Our `router_bias` (aux-loss-free selection bias) has no HF counterpart: imported as zeros, and
exporting a non-zero one is refused.
"""
from __future__ import annotations

import functools
import re
from typing import Any, Iterable, Mapping

import numpy as np

from MaxText.models.llama import hf_map as llama
from MaxText.models.model_config import ModelConfig
from MaxText.models.name_map import (CAUSAL_LM_RULES, FolderMap, NameMap, Rule,
                                     check_representable, self_attention_rules)
from MaxText.models.llama import qwen3_moe_hf_map as qwen3_moe
from MaxText.models.qwen3_next.model import Transformer, layer_location, mixer_types

_L = "model.layers.{i}."
LAYER_RULES: tuple[Rule, ...] = (
    Rule("input_norm/scale", _L + "input_layernorm.weight"),
    Rule("post_attention_norm/scale", _L + "post_attention_layernorm.weight"),
    *self_attention_rules(_L),
    Rule("attn/query_norm/scale", _L + "self_attn.q_norm.weight"),
    Rule("attn/key_norm/scale", _L + "self_attn.k_norm.weight"),
    Rule("linear_attn/in_proj_qkvz/kernel", _L + "linear_attn.in_proj_qkvz.weight", in_rank=1),
    Rule("linear_attn/in_proj_ba/kernel", _L + "linear_attn.in_proj_ba.weight", in_rank=1),
    Rule("linear_attn/conv", _L + "linear_attn.conv1d.weight", in_rank=1),   # through _ConvLayout
    Rule("linear_attn/A_log", _L + "linear_attn.A_log"),
    Rule("linear_attn/dt_bias", _L + "linear_attn.dt_bias"),
    Rule("linear_attn/norm/scale", _L + "linear_attn.norm.weight"),
    Rule("linear_attn/out_proj/kernel", _L + "linear_attn.out_proj.weight", in_rank=2),
    *llama.DENSE_MLP_RULES,
    qwen3_moe.ROUTER,
    Rule("mlp/shared/gate/kernel", _L + "mlp.shared_expert.gate_proj.weight", in_rank=1),
    Rule("mlp/shared/up/kernel", _L + "mlp.shared_expert.up_proj.weight", in_rank=1),
    Rule("mlp/shared/down/kernel", _L + "mlp.shared_expert.down_proj.weight", in_rank=1),
    Rule("mlp/shared_gate/kernel", _L + "mlp.shared_expert_gate.weight", in_rank=1),
)
MTP_RULES: tuple[Rule, ...] = (
    Rule("mtp/fc/kernel", "mtp.fc.weight", in_rank=1),
    Rule("mtp/pre_fc_norm_embedding/scale", "mtp.pre_fc_norm_embedding.weight"),
    Rule("mtp/pre_fc_norm_hidden/scale", "mtp.pre_fc_norm_hidden.weight"),
    Rule("mtp/norm/scale", "mtp.norm.weight"),
)
_CONV = re.compile(r"(model|mtp)\.layers\.\d+\.linear_attn\.conv1d\.weight$")
_MTP_LAYER = re.compile(r"mtp\.layers\.(\d+)\.")


def mtp_layer_rules(j: int, layer_rules: Iterable[Rule]) -> tuple[Rule, ...]:
  """A decoder layer's rows as MTP layer j's (global rows: mtp.layers.{j}. ↔ mtp/layers/{j}/)."""
  return tuple(Rule(f"mtp/layers/{j}/{r.ours}", r.hf.replace(_L, f"mtp.layers.{j}."), r.in_rank,
                    r.lead, r.expert, r.part) for r in layer_rules)


@functools.lru_cache(maxsize=None)
def name_map(mtp_layers: int, fused: bool) -> NameMap:
  """The map of a model with `mtp_layers` MTP layers, experts in the hub's per-expert form or
  transformers' fused one."""
  layer = LAYER_RULES + (qwen3_moe.FUSED_RULES if fused else qwen3_moe.PER_EXPERT_RULES)
  mtp = () if not mtp_layers else MTP_RULES + tuple(
      r for j in range(mtp_layers)
      for r in mtp_layer_rules(j, LAYER_RULES + qwen3_moe.PER_EXPERT_RULES))
  return NameMap(CAUSAL_LM_RULES + mtp, layer, layer_location,
                 Transformer, check=lambda mcfg: config_to_hf(mcfg), ours_only=("router_bias",),
                 ignored_suffixes=llama.IGNORED_SUFFIXES)


class _ConvLayout(Mapping):
  """HF tensors with each conv1d weight [Cq+Ck+Cv, 1, W] shown in our channel order as a 2-D
  [Hk·X, W] (`to_ours`), or ours shown as HF's (`to_hf`); every other tensor as it is."""

  def __init__(self, tensors: Mapping[str, Any], mcfg: ModelConfig, *, to_ours: bool):
    self._tensors, self._to_ours = tensors, to_ours
    Hk, Hv = mcfg.linear_num_key_heads, mcfg.linear_num_value_heads
    Dk, Dv = mcfg.linear_key_head_dim, mcfg.linear_value_head_dim
    if not Hk:
      self._order = None
      return
    G = Hv // Hk
    head = np.arange(Hk)[:, None]
    # our row (key head h, channel c of its q | k | v) ← HF channel
    self._order = np.concatenate([head * Dk + np.arange(Dk),
                                  Hk * Dk + head * Dk + np.arange(Dk),
                                  2 * Hk * Dk + head * G * Dv + np.arange(G * Dv)], axis=1).ravel()

  def relayout(self, name: str, shape: tuple[int, ...]):
    """(HF tensor → ours, the shape it gives) for a conv1d weight of shape [C, 1, W], else None
    (FolderMap.relayout)."""
    order = self._order
    if order is None or not _CONV.search(name) or len(shape) != 3:
      return None
    return (lambda w: np.asarray(w)[:, 0][order]), (len(order), shape[2])

  def __getitem__(self, name: str):
    value = self._tensors[name]
    if self._order is None or not _CONV.search(name):
      return value
    if self._to_ours:
      return np.asarray(value)[:, 0][self._order]
    return value[np.argsort(self._order)][:, None]   # HF channel ← our row (a jax.Array stays one)

  def __iter__(self):
    return iter(self._tensors)

  def __len__(self) -> int:
    return len(self._tensors)


_fused = qwen3_moe.is_fused


def hf_names(mcfg: ModelConfig, *, tied_lm_head: bool = False) -> list[str]:
  """The hub's (per-expert) names."""
  return name_map(mcfg.mtp_num_layers, False).hf_names(mcfg, tied_lm_head=tied_lm_head)


def hf_to_params(hf_state: Mapping[str, np.ndarray], mcfg: ModelConfig) -> dict:
  """HF tensors (hub per-expert files or transformers' fused state dict) → our params."""
  nm = name_map(mcfg.mtp_num_layers, _fused(hf_state))
  return nm.hf_to_params(_ConvLayout(hf_state, mcfg, to_ours=True), mcfg)


def folder_map(names: Iterable[str], mcfg: ModelConfig) -> FolderMap:
  """The rows `hf_to_params` uses for a folder holding tensors `names`, read a box at a time; the
  conv1d weights (channels regrouped per key head) are read whole and laid out as ours."""
  return FolderMap(name_map(mcfg.mtp_num_layers, _fused(names)),
                   relayout=_ConvLayout({}, mcfg, to_ours=True).relayout)


def params_to_hf(params: Mapping, mcfg: ModelConfig, *, tied_lm_head: bool = False,
                 fused: bool = False, on_device: bool = False) -> Mapping[str, np.ndarray]:
  """Our params → HF tensors (lazy): the hub's per-expert form, or transformers' fused one (the
  MTP block, which transformers does not have, always per expert); `on_device`: NameMap's."""
  nm = name_map(mcfg.mtp_num_layers, fused)
  return _ConvLayout(nm.params_to_hf(params, mcfg, tied_lm_head=tied_lm_head,
                                     on_device=on_device), mcfg, to_ours=False)


def config_from_tensor_names(names: Iterable[str]) -> dict[str, Any]:
  """What config.json does not say: the MTP layers a checkpoint carries."""
  layers = {int(m.group(1)) for m in map(_MTP_LAYER.match, names) if m}
  return {"mtp_num_layers": max(layers) + 1 if layers else 0}


# ---- config --------------------------------------------------------------------------------------
_TYPES = {"linear_attention": "l", "full_attention": "f"}
REPRESENTS = frozenset({
    "vocab_size", "emb_dim", "num_decoder_layers", "num_query_heads", "num_kv_heads", "head_dim",
    "mlp_dim", "mlp_activation", "norm_epsilon", "tie_word_embeddings", "rope_theta",
    "max_position_embeddings", "attention_pattern", "partial_rotary_factor",
    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
    "linear_value_head_dim", "linear_conv_kernel_dim", "num_experts", "num_experts_per_tok",
    "moe_mlp_dim", "norm_topk_prob", "shared_expert_mlp_dim", "mlp_only_layers",
    "decoder_sparse_step", "mtp_num_layers"})


def _pattern(letters: str) -> str:
  """The shortest pattern whose repetition gives `letters`."""
  n = len(letters)
  return next(letters[:p] for p in range(1, n + 1)
              if n % p == 0 and letters[:p] * (n // p) == letters)


def _rope(hf: Mapping[str, Any]) -> tuple[float, float]:
  """(θ, partial_rotary_factor) from transformers 5's `rope_parameters` or 4.x's top-level keys."""
  rope = dict(hf.get("rope_parameters") or {})
  for src in (rope, dict(hf.get("rope_scaling") or {})):
    kind = src.get("rope_type", src.get("type", "default"))
    if kind != "default":
      raise ValueError(f"rope type {kind!r} is not supported (only default RoPE)")
  theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
  partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
  return float(theta), float(partial)


def config_from_hf(hf_config: Mapping[str, Any]) -> dict[str, Any]:
  """HF Qwen3-Next config (config.json or `Qwen3NextConfig.to_dict()`) → our keys; missing
  optional fields take `Qwen3NextConfig`'s defaults."""
  hf = dict(hf_config)
  if hf.get("model_type", "qwen3_next") != "qwen3_next":
    raise ValueError(f"model_type={hf.get('model_type')!r}: this map is for 'qwen3_next'")
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"hidden_act={hf['hidden_act']!r}: only silu is supported")
  if hf.get("attention_bias", False):
    raise ValueError("attention_bias=true is not supported (our projections have no bias)")
  L = int(hf["num_hidden_layers"])
  types = hf.get("layer_types") or [
      "full_attention" if (i + 1) % int(hf.get("full_attention_interval", 4)) == 0
      else "linear_attention" for i in range(L)]
  unknown = sorted(set(types) - set(_TYPES))
  if unknown or len(types) != L:
    raise ValueError(f"layer_types: expected {L} of {sorted(_TYPES)}, got {types}")
  theta, partial = _rope(hf)
  H = int(hf["num_attention_heads"])
  experts = int(hf.get("num_experts", 512))
  return {
      "decoder_block": "qwen3_next",
      "hf_model_type": "qwen3_next",
      "vocab_size": int(hf["vocab_size"]),
      "emb_dim": int(hf["hidden_size"]),
      "num_decoder_layers": L,
      "num_query_heads": H,
      "num_kv_heads": int(hf.get("num_key_value_heads") or H),
      "head_dim": int(hf.get("head_dim") or 256),
      "mlp_dim": int(hf.get("intermediate_size", 5632)),
      "mlp_activation": "silu",
      "norm_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
      "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
      "rope_theta": theta,
      "partial_rotary_factor": partial,
      "max_position_embeddings": int(hf.get("max_position_embeddings", 32768)),
      "attention_pattern": _pattern("".join(_TYPES[t] for t in types)),
      "linear_num_key_heads": int(hf.get("linear_num_key_heads", 16)),
      "linear_num_value_heads": int(hf.get("linear_num_value_heads", 32)),
      "linear_key_head_dim": int(hf.get("linear_key_head_dim", 128)),
      "linear_value_head_dim": int(hf.get("linear_value_head_dim", 128)),
      "linear_conv_kernel_dim": int(hf.get("linear_conv_kernel_dim", 4)),
      "num_experts": experts,
      "num_experts_per_tok": int(hf.get("num_experts_per_tok", 10)),
      "moe_mlp_dim": int(hf.get("moe_intermediate_size", 512)) if experts else 0,
      "shared_expert_mlp_dim": (int(hf.get("shared_expert_intermediate_size", 512)) if experts
                                else 0),
      "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
      "mlp_only_layers": sorted(int(i) for i in hf.get("mlp_only_layers") or []),
      "decoder_sparse_step": int(hf.get("decoder_sparse_step", 1)),
      "mtp_num_layers": int(hf.get("num_nextn_predict_layers", 0)),
      # the load-balancing loss's weight the model was trained with (Qwen3NextConfig default)
      **({"moe_aux_loss_weight": float(hf.get("router_aux_loss_coef", 0.001))} if experts else {}),
  }


def config_to_hf(cfg: Any) -> dict[str, Any]:
  """Our config (`Config`, `ModelConfig` or a dict of our keys) → HF Qwen3-Next config dict
  (θ and the partial rotary factor in both the 5.x and 4.x places; the MTP layers as
  `num_nextn_predict_layers`, the name vLLM reads). ValueError when Qwen3-Next cannot hold it."""
  get = llama.getter(cfg)
  if get("decoder_block") != "qwen3_next" or get("mlp_activation") != "silu":
    raise ValueError("qwen3_next needs decoder_block=qwen3_next and mlp_activation=silu")
  if get("num_experts") and not get("shared_expert_mlp_dim"):
    raise ValueError("Qwen3-Next's MoE layers always have a shared expert "
                     "(shared_expert_mlp_dim > 0)")
  if not isinstance(cfg, Mapping):
    check_representable(cfg, REPRESENTS, "qwen3_next")
  partial = float(get("partial_rotary_factor"))
  out = llama.causal_lm_keys_to_hf(get, "qwen3_next", "Qwen3NextForCausalLM")
  out["rope_parameters"]["partial_rotary_factor"] = out["partial_rotary_factor"] = partial
  out.update({
      "layer_types": [f"{t}_attention" for t in mixer_types(get("attention_pattern"),
                                                             int(get("num_decoder_layers")))],
      "linear_num_key_heads": int(get("linear_num_key_heads")),
      "linear_num_value_heads": int(get("linear_num_value_heads")),
      "linear_key_head_dim": int(get("linear_key_head_dim")),
      "linear_value_head_dim": int(get("linear_value_head_dim")),
      "linear_conv_kernel_dim": int(get("linear_conv_kernel_dim")),
      "num_experts": int(get("num_experts")),
      "num_experts_per_tok": int(get("num_experts_per_tok")),
      "moe_intermediate_size": int(get("moe_mlp_dim")),
      "shared_expert_intermediate_size": int(get("shared_expert_mlp_dim")),
      "norm_topk_prob": bool(get("norm_topk_prob")),
      "mlp_only_layers": sorted(int(i) for i in get("mlp_only_layers")),
      "decoder_sparse_step": int(get("decoder_sparse_step")),
  })
  if get("num_experts"):
    out["router_aux_loss_coef"] = float(get("moe_aux_loss_weight"))
  if get("mtp_num_layers"):
    out["num_nextn_predict_layers"] = int(get("mtp_num_layers"))
  return out
