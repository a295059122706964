"""The `gemma4` family (Gemma 4 text): what generic code knows of it (MaxText/models/family.py)."""
from __future__ import annotations

from MaxText.layers.moe import MoETerms, active_matmul_params
from MaxText.metrics.flops import (FlopCount, attention_pairs, attention_params,
                                   attention_score_flops, gated_mlp_params)
from MaxText.models.family import (COMMON_KEYS, ROUTED_EXPERT_KEYS, Family, Problems,
                                   routed_expert_problems)
from MaxText.models.gemma4 import hf_map
from MaxText.models.gemma4.model import (Transformer, attention_types, decode_cache,
                                         first_kv_shared_layer, head_dim_of, kv_heads_of,
                                         layer_kinds)
from MaxText.models.gemma4.keys import Keys
from MaxText.models.model_config import ModelConfig

# the schema's shared keys it implements; its own (keys.py) are supported through keys=Keys
GEMMA4_KEYS = frozenset({
    "mlp_activation", "use_qk_norm", "tie_word_embeddings", "attention_pattern", "sliding_window"})


def check(cfg: ModelConfig) -> Problems:
  """Family checks, run before anything compiles: [(key, problem)]."""
  try:
    types = attention_types(cfg)
  except ValueError as e:
    return [("attention_pattern", str(e))]
  problems = routed_expert_problems(cfg, ROUTED_EXPERT_KEYS)
  for t in sorted(set(types)):
    K, E = kv_heads_of(cfg, t), head_dim_of(cfg, t)
    key = "global_num_kv_heads" if t == "full" and cfg.global_num_kv_heads else "num_kv_heads"
    if cfg.num_query_heads % K:
      problems.append((key, f"num_query_heads={cfg.num_query_heads} is not a multiple of the "
                            f"{K} kv heads of {t} layers"))
    if E % 2:
      problems.append(("global_head_dim" if t == "full" and cfg.global_head_dim else "head_dim",
                       f"{t} layers' head width {E} must be even for RoPE"))
  if types[-1] != "full":
    problems.append(("attention_pattern", f"{cfg.attention_pattern!r} over {len(types)} layers "
                     f"makes the last layer sliding; Gemma 4 needs it full (transformers forces it)"))
  if "sliding" in types and cfg.sliding_window < 1:
    problems.append(("sliding_window", "the pattern has sliding layers but sliding_window=0"))
  if not cfg.use_qk_norm:
    problems.append(("use_qk_norm", "Gemma 4 always normalises q and k; set use_qk_norm=true"))
  if cfg.num_experts and not cfg.norm_topk_prob:
    problems.append(("norm_topk_prob", "Gemma 4's router always renormalises the top-k weights"))
  if cfg.num_kv_shared_layers >= cfg.num_decoder_layers:
    problems.append(("num_kv_shared_layers", f"{cfg.num_kv_shared_layers} shared layers leave no "
                     f"layer of the {cfg.num_decoder_layers} to produce K/V"))
  else:
    first = first_kv_shared_layer(cfg)
    for t in sorted(set(types[first:]) - set(types[:first])):
      problems.append(("num_kv_shared_layers", f"the shared tail has {t} layers but no earlier "
                       f"{t} layer produces their K/V"))
  return problems


def flops(cfg: ModelConfig, seq_len: int, causal: bool = True) -> FlopCount:
  """Per layer its own kind: head width and kv heads of its attention kind, no k/v projections
  on kv-shared layers (and a 2x MLP with double_wide_mlp_on_shared), no v projection on full
  layers with attention_k_eq_v, the routed experts beside the dense MLP, the PLE gate and
  projection; a sliding layer's attention admits only its window. Plus the LM head and the PLE
  model projection D x L*P."""
  D, H, P, L = cfg.emb_dim, cfg.num_query_heads, cfg.per_layer_input_dim, cfg.num_decoder_layers
  params = D * cfg.vocab_size + D * L * P
  attention = 0.0
  for kind in layer_kinds(cfg):
    full, shared = kind.attention == "full", kind.kv_shared
    E, K = head_dim_of(cfg, kind.attention), kv_heads_of(cfg, kind.attention)
    params += attention_params(D, H, K, E, keys=not shared,
                               values=not shared and not (full and cfg.attention_k_eq_v))
    wide = 2 if shared and cfg.double_wide_mlp_on_shared else 1
    params += gated_mlp_params(D, cfg.mlp_dim * wide) + 2 * D * P
    if cfg.num_experts:
      params += active_matmul_params(D, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_mlp_dim)
    window = 0 if full else cfg.sliding_window
    attention += attention_score_flops(attention_pairs(seq_len, window=window, causal=causal), H, E)
  return FlopCount(matmul_params=params, attention_per_sequence=attention)


def attention_head_dims(cfg: ModelConfig) -> tuple[int, ...]:
  return tuple(sorted({head_dim_of(cfg, t) for t in attention_types(cfg)}))


def aux_terms(cfg: ModelConfig) -> MoETerms | None:
  if not cfg.num_experts:
    return None
  return MoETerms(cfg.moe_aux_loss_weight, cfg.router_bias_update_rate,
                  tuple(range(cfg.num_decoder_layers)), cfg.num_experts, cfg.num_experts_per_tok)


FAMILY = Family(
    name="gemma4",
    build=Transformer,
    keys=Keys,
    supports=COMMON_KEYS | ROUTED_EXPERT_KEYS | GEMMA4_KEYS,
    layer_kinds=layer_kinds,
    flops=flops,
    check=check,
    attention_head_dims=attention_head_dims,
    aux_terms=aux_terms,
    decode_cache=decode_cache,
    hf_maps={"gemma4_text": hf_map, "gemma4": hf_map},   # gemma4: multimodal, the text model only
)
