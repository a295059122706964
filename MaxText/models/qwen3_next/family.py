"""The `qwen3_next` family (Qwen3-Next: Gated DeltaNet + gated attention + shared-expert MoE): what
generic code knows of it (MaxText/models/family.py)."""
from __future__ import annotations

import math

from MaxText.layers.moe import MoETerms, active_matmul_params
from MaxText.metrics.flops import (FlopCount, attention_pairs, attention_params,
                                   attention_score_flops, gated_delta_flops, gated_mlp_params)
from MaxText.models.family import (COMMON_KEYS, ROUTED_EXPERT_KEYS, Family, Problems,
                                   dense_layer_problems, mtp_problems,
                                   routed_expert_problems)
from MaxText.models.qwen3_next.keys import Keys
from MaxText.models.model_config import ModelConfig
from MaxText.models.qwen3_next import hf_map
from MaxText.models.qwen3_next.model import (FULL, LINEAR, MOE, Transformer, decode_cache,
                                             layer_kinds, moe_layers)

DENSE_LAYER_KEYS = ("mlp_only_layers", "decoder_sparse_step")
EXPERT_KEYS = ROUTED_EXPERT_KEYS | {"shared_expert_mlp_dim", *DENSE_LAYER_KEYS}
LINEAR_KEYS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
               "linear_value_head_dim")
# the schema's shared keys it implements; its own (keys.py) are supported through keys=Keys
QWEN3_NEXT_KEYS = frozenset({"mlp_activation", "tie_word_embeddings", "attention_pattern",
                             "partial_rotary_factor", "mtp_num_layers", "mtp_loss_scale"})


def check(cfg: ModelConfig) -> Problems:
  """Family checks, run before anything compiles: [(key, problem)]."""
  try:
    kinds = layer_kinds(cfg)
  except ValueError as e:
    return [("attention_pattern", str(e))]
  problems = routed_expert_problems(cfg, EXPERT_KEYS)
  if cfg.num_query_heads % cfg.num_kv_heads:
    problems.append(("num_kv_heads", f"num_query_heads={cfg.num_query_heads} is not a multiple "
                                      f"of num_kv_heads={cfg.num_kv_heads}"))
  rotary = int(cfg.head_dim * cfg.partial_rotary_factor)
  if rotary < 2 or rotary % 2:
    problems.append(("partial_rotary_factor", f"{cfg.partial_rotary_factor} x head_dim="
                     f"{cfg.head_dim} rotates {rotary} channels; RoPE needs an even number >= 2"))
  if any(k.mixer == LINEAR for k in kinds):
    for key in LINEAR_KEYS:
      if getattr(cfg, key) < 1:
        problems.append((key, f"{key}=0 but attention_pattern={cfg.attention_pattern!r} has "
                              f"linear layers"))
    if cfg.linear_num_key_heads and cfg.linear_num_value_heads % cfg.linear_num_key_heads:
      problems.append(("linear_num_value_heads", f"{cfg.linear_num_value_heads} value heads are "
                       f"not a multiple of linear_num_key_heads={cfg.linear_num_key_heads}"))
  problems += dense_layer_problems(cfg, moe_layers(cfg), DENSE_LAYER_KEYS)
  return problems + mtp_problems(cfg)


def _linear_params(cfg: ModelConfig) -> int:
  D, Hk, Hv = cfg.emb_dim, cfg.linear_num_key_heads, cfg.linear_num_value_heads
  Dk, Dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
  return D * (2 * Hk * Dk + 2 * Hv * Dv) + D * 2 * Hv + Hv * Dv * D   # qkvz, ba, out


def flops(cfg: ModelConfig, seq_len: int, causal: bool = True) -> FlopCount:
  """Per layer its kind: gated attention (q projection 2x wide for the gate; causal scores) or
  Gated DeltaNet (in/out projections; the chunked rule, linear in the sequence); the MoE's router,
  k experts and shared expert, or the dense MLP. Plus the LM head."""
  D, H, K, E = cfg.emb_dim, cfg.num_query_heads, cfg.num_kv_heads, cfg.head_dim
  params = D * cfg.vocab_size
  mixing = 0.0
  for kind in layer_kinds(cfg):
    if kind.mixer == FULL:
      params += attention_params(D, H, K, E) + D * H * E
      mixing += attention_score_flops(attention_pairs(seq_len, causal=causal), H, E)
    else:
      params += _linear_params(cfg)
      mixing += gated_delta_flops(seq_len, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                  cfg.linear_value_head_dim, cfg.linear_chunk_size)
    params += (active_matmul_params(D, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_mlp_dim,
                                    cfg.shared_expert_mlp_dim) if kind.mlp == MOE
               else gated_mlp_params(D, cfg.mlp_dim))
  return FlopCount(matmul_params=params, attention_per_sequence=mixing)


def recurrent_state_bytes(cfg: ModelConfig, sequences: float, seq_len: int) -> int:
  """The delta-rule states the chunked rule keeps for the backward pass (one [Hv, Dk, Dv] fp32
  state per chunk and sequence): of every linear layer with remat_policy=none, else of the one
  layer being differentiated."""
  linear = sum(k.mixer == LINEAR for k in layer_kinds(cfg))
  if not linear:
    return 0
  per_layer = (math.ceil(seq_len / cfg.linear_chunk_size) * cfg.linear_num_value_heads
               * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4)
  layers = linear if cfg.remat_policy == "none" else 1
  return int(math.ceil(sequences) * per_layer * layers)


def aux_terms(cfg: ModelConfig) -> MoETerms | None:
  layers = moe_layers(cfg)
  return MoETerms(cfg.moe_aux_loss_weight, cfg.router_bias_update_rate, layers, cfg.num_experts,
                  cfg.num_experts_per_tok) if layers else None


def frozen(cfg: ModelConfig) -> tuple[str, ...]:
  """The MTP block is carried, not trained, unless mtp_loss_scale > 0."""
  return ("mtp",) if cfg.mtp_num_layers and not cfg.mtp_loss_scale else ()


FAMILY = Family(
    name="qwen3_next",
    build=Transformer,
    keys=Keys,
    supports=COMMON_KEYS | EXPERT_KEYS | QWEN3_NEXT_KEYS,
    layer_kinds=layer_kinds,
    flops=flops,
    check=check,
    aux_terms=aux_terms,
    frozen=frozen,
    context_parallel=False,
    activation_bytes=recurrent_state_bytes,
    decode_cache=decode_cache,
    hf_maps={"qwen3_next": hf_map},
)
