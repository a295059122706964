"""Hugging Face Qwen3-MoE (`model_type: qwen3_moe`, `Qwen3MoeForCausalLM`) ↔ our `llama` family
with `num_experts > 0` (MaxText/layers/moe.py).

Attention, norms and embeddings map as for Qwen3 (MaxText/models/llama/qwen3_hf_map.py). Layer i is a
MoE layer unless it is in `mlp_only_layers` or (i + 1) % `decoder_sparse_step` != 0 — both keys
are ours too, and an export writes our `first_k_dense_layers` into `mlp_only_layers`; a dense
layer's MLP maps as Qwen3's (`mlp.gate_proj`, ...). The experts of a MoE layer:
  ours  mlp/experts/wi [E, D, 2F] (gate | up)    mlp/experts/wo [E, F, D]    mlp/router/kernel [D, E]
  hub files (what `save_pretrained` writes, per expert):
        mlp.experts.{e}.gate_proj.weight [F, D] → wi[e, :, :F]     up_proj [F, D] → wi[e, :, F:]
        mlp.experts.{e}.down_proj.weight [D, F] → wo[e]            mlp.gate.weight [E, D] → router
  transformers' in-memory state dict (fused):
        mlp.experts.gate_up_proj [E, 2F, D] (gate rows first) → wi     mlp.experts.down_proj [E, D, F] → wo
Import accepts either form; export writes the hub's per-expert form. Our `router_bias` (the
aux-loss-free selection bias) has no Hugging Face counterpart: it is imported as zeros, and an
export of a model whose bias is not all zero is refused (transformers would route differently).
No shared expert.
"""
from __future__ import annotations

import functools
from typing import Any, Iterable, Mapping

import numpy as np

from MaxText.models.llama import hf_map as llama
from MaxText.models.llama import qwen3_hf_map as qwen3
from MaxText.models.llama.model import Transformer, layer_location
from MaxText.models.model_config import ModelConfig
from MaxText.models.name_map import FolderMap, NameMap, Rule, check_representable

_L = "model.layers.{i}.mlp."
ROUTER = Rule("mlp/router/kernel", _L + "gate.weight", in_rank=1)
PER_EXPERT_RULES = (
    Rule("mlp/experts/wi", _L + "experts.{e}.gate_proj.weight", in_rank=1, expert=True, part=(0, 2)),
    Rule("mlp/experts/wi", _L + "experts.{e}.up_proj.weight", in_rank=1, expert=True, part=(1, 2)),
    Rule("mlp/experts/wo", _L + "experts.{e}.down_proj.weight", in_rank=1, expert=True),
)
FUSED_RULES = (
    Rule("mlp/experts/wi", _L + "experts.gate_up_proj", in_rank=1, lead=1),
    Rule("mlp/experts/wo", _L + "experts.down_proj", in_rank=1, lead=1),
)
_LAYER = qwen3.LAYER_RULES + (ROUTER,)   # a dense layer's MLP rows match only dense layers
_NAME_MAP = functools.partial(
    NameMap, layer_location=layer_location, build=Transformer, ours_only=("router_bias",),
    check=lambda mcfg: config_to_hf(mcfg), ignored_suffixes=qwen3.IGNORED_SUFFIXES)
HUB_MAP = _NAME_MAP(qwen3.GLOBAL_RULES, _LAYER + PER_EXPERT_RULES)
FUSED_MAP = _NAME_MAP(qwen3.GLOBAL_RULES, _LAYER + FUSED_RULES)
CHECKPOINT_MAP = HUB_MAP   # refit.stream's "checkpoint" layout (refit.Receiver reads it back)
REPRESENTS = qwen3.REPRESENTS | {"num_experts", "num_experts_per_tok", "moe_mlp_dim",
                                 "norm_topk_prob", "first_k_dense_layers", "mlp_only_layers",
                                 "decoder_sparse_step"}


hf_names = HUB_MAP.hf_names   # the hub's (per-expert) names


def is_fused(names: Iterable[str]) -> bool:
  """Whether a checkpoint's experts are transformers' fused tensors (else the hub's per-expert
  files)."""
  return any(k.endswith("mlp.experts.gate_up_proj") for k in names)


def hf_to_params(hf_state: Mapping[str, np.ndarray], mcfg: ModelConfig) -> dict:
  """HF tensors (hub per-expert files or transformers' fused state dict) → our params."""
  return (FUSED_MAP if is_fused(hf_state) else HUB_MAP).hf_to_params(hf_state, mcfg)


def folder_map(names: Iterable[str], mcfg: ModelConfig) -> FolderMap:
  """The rows `hf_to_params` uses for a folder holding tensors `names`, read a box at a time."""
  return FolderMap(FUSED_MAP if is_fused(names) else HUB_MAP)


def params_to_hf(params: Mapping, mcfg: ModelConfig, *, tied_lm_head: bool = False,
                 fused: bool = False, on_device: bool = False) -> Mapping[str, np.ndarray]:
  """Our params → HF tensors (lazy): the hub's per-expert form, or transformers' fused one."""
  return (FUSED_MAP if fused else HUB_MAP).params_to_hf(params, mcfg, tied_lm_head=tied_lm_head,
                                                        on_device=on_device)


# ---- config --------------------------------------------------------------------------------------
def config_from_hf(hf_config: Mapping[str, Any]) -> dict[str, Any]:
  """HF Qwen3-MoE config → our keys (Qwen3MoeConfig defaults for missing optional fields)."""
  hf = dict(hf_config)
  if hf.get("model_type", "qwen3_moe") != "qwen3_moe":
    raise ValueError(f"model_type={hf.get('model_type')!r}: this map is for 'qwen3_moe'")
  if hf.get("shared_expert_intermediate_size"):
    raise ValueError("shared_expert_intermediate_size: Qwen3-MoE has no shared expert")
  keys = qwen3.dense_keys_from_hf(hf)
  keys.update({
      "hf_model_type": "qwen3_moe",
      "mlp_dim": int(hf.get("intermediate_size", 6144)),
      # config.json says num_experts; transformers 5's to_dict() says num_local_experts
      "num_experts": int(hf.get("num_experts") or hf.get("num_local_experts") or 128),
      "num_experts_per_tok": int(hf.get("num_experts_per_tok", 8)),
      "moe_mlp_dim": int(hf.get("moe_intermediate_size", 768)),
      "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
      "mlp_only_layers": sorted(int(i) for i in hf.get("mlp_only_layers") or []),
      "decoder_sparse_step": int(hf.get("decoder_sparse_step", 1)),
      # the load-balancing loss's weight the model was trained with (Qwen3MoeConfig default)
      "moe_aux_loss_weight": float(hf.get("router_aux_loss_coef", 0.001)),
  })
  return keys


def config_to_hf(cfg: Any) -> dict[str, Any]:
  """Our config → HF Qwen3-MoE config dict (ValueError when Qwen3-MoE cannot hold the model)."""
  get = llama.getter(cfg)
  if not get("num_experts") or get("shared_expert_mlp_dim"):
    raise ValueError("Qwen3-MoE needs num_experts > 0 and no shared expert")
  if not isinstance(cfg, Mapping):
    check_representable(cfg, REPRESENTS, "qwen3_moe")
  out = qwen3.dense_keys_to_hf(get, "qwen3_moe", "Qwen3MoeForCausalLM")
  dense = set(get("mlp_only_layers")) | set(range(int(get("first_k_dense_layers"))))
  out.update({
      "num_experts": int(get("num_experts")),
      "num_experts_per_tok": int(get("num_experts_per_tok")),
      "moe_intermediate_size": int(get("moe_mlp_dim")),
      "norm_topk_prob": bool(get("norm_topk_prob")),
      "router_aux_loss_coef": float(get("moe_aux_loss_weight")),
      "decoder_sparse_step": int(get("decoder_sparse_step")),
      "mlp_only_layers": sorted(int(i) for i in dense),
  })
  return out
