"""The `llama` family (Llama, Qwen3, Qwen3-MoE, DeepSeek-style dense-then-MoE): what generic code
knows of it (MaxText/models/family.py)."""
from __future__ import annotations

from MaxText.layers.moe import MoETerms, active_matmul_params
from MaxText.metrics.flops import (FlopCount, attention_pairs, attention_params,
                                   attention_score_flops, gated_mlp_params)
from MaxText.models.family import (COMMON_KEYS, ROUTED_EXPERT_KEYS, Family, Problems,
                                   dense_layer_problems, mtp_problems,
                                   routed_expert_problems)
from MaxText.models.llama import hf_map as llama_hf
from MaxText.models.llama.model import MOE, Transformer, decode_cache, layer_kinds, moe_layers
from MaxText.models.llama.keys import Keys
from MaxText.models.model_config import ModelConfig
from MaxText.models.llama import qwen3_hf_map as qwen3_hf
from MaxText.models.llama import qwen3_moe_hf_map as qwen3_moe_hf

DENSE_LAYER_KEYS = ("first_k_dense_layers", "mlp_only_layers", "decoder_sparse_step")
EXPERT_KEYS = ROUTED_EXPERT_KEYS | {"shared_expert_mlp_dim", *DENSE_LAYER_KEYS}


def check(cfg: ModelConfig) -> Problems:
  problems = routed_expert_problems(cfg, EXPERT_KEYS)
  if cfg.num_query_heads % cfg.num_kv_heads:
    problems.append(("num_kv_heads", f"num_query_heads={cfg.num_query_heads} is not a multiple "
                                      f"of num_kv_heads={cfg.num_kv_heads}"))
  if cfg.head_dim % 2:
    problems.append(("head_dim", f"head_dim={cfg.head_dim} must be even for RoPE"))
  return (problems + dense_layer_problems(cfg, moe_layers(cfg), DENSE_LAYER_KEYS)
          + mtp_problems(cfg))


def flops(cfg: ModelConfig, seq_len: int, causal: bool = True) -> FlopCount:
  D, H, K, E = cfg.emb_dim, cfg.num_query_heads, cfg.num_kv_heads, cfg.head_dim
  params = D * cfg.vocab_size     # the LM head
  for kind in layer_kinds(cfg):
    params += attention_params(D, H, K, E)
    params += (active_matmul_params(D, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_mlp_dim,
                                    cfg.shared_expert_mlp_dim) if kind == MOE
               else gated_mlp_params(D, cfg.mlp_dim))
  scores = attention_score_flops(attention_pairs(seq_len, causal=causal), H, E)
  return FlopCount(matmul_params=params, attention_per_sequence=cfg.num_decoder_layers * scores)


def aux_terms(cfg: ModelConfig) -> MoETerms | None:
  layers = moe_layers(cfg)
  if not layers:
    return None
  return MoETerms(cfg.moe_aux_loss_weight, cfg.router_bias_update_rate, layers, cfg.num_experts,
                  cfg.num_experts_per_tok)


def frozen(cfg: ModelConfig) -> tuple[str, ...]:
  """An MTP block the run does not train (mtp_loss_scale = 0) is carried unchanged."""
  return ("mtp",) if cfg.mtp_num_layers and not cfg.mtp_loss_scale else ()


FAMILY = Family(
    name="llama",
    build=Transformer,
    keys=Keys,
    supports=COMMON_KEYS | EXPERT_KEYS | {"mlp_activation", "use_qk_norm", "tie_word_embeddings",
                                          "mtp_num_layers", "mtp_loss_scale",
                                          "weight_quant_vocab"},
    layer_kinds=layer_kinds,
    flops=flops,
    check=check,
    aux_terms=aux_terms,
    frozen=frozen,
    decode_cache=decode_cache,
    hf_maps={"llama": llama_hf, "qwen3": qwen3_hf, "qwen3_moe": qwen3_moe_hf},
)
