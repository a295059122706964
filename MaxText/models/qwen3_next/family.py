"""The `qwen3_next` family (Qwen3-Next: Gated DeltaNet + gated attention + shared-expert MoE): what
generic code knows of it (MaxText/models/family.py)."""
from __future__ import annotations

import math

import jax.numpy as jnp

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
                             "partial_rotary_factor", "mtp_num_layers", "mtp_loss_scale",
                             "weight_quant_vocab"})


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


def linear_layer_bytes(cfg: ModelConfig, sequences: float, seq_len: int) -> int:
  """What a Gated DeltaNet layer keeps beyond a generic decoder layer (`memory.activation_bytes`
  counts every layer as a softmax-attention one) while it is differentiated: its forward,
  recomputed, holds the chunked rule's fp32 arrays (MaxText/layers/gated_delta.py,
  gated_deltanet.py) until its backward has read them — and the MLP's backward runs first, on top
  of them. Per token (tokens padded to whole chunks of C; Hk / Hv key / value heads, Dk / Dv their
  widths, X = 2·Dk + (Hv/Hk)·Dv a key head's q|k|v channels), in fp32:
    the conv's output q|k|v and its SiLU, 2·Hk·X; q, k (repeated to the value heads) and v, as the
    layer hands them over and cut into chunks, 2·Hv·(2·Dk + Dv); the triangular solve's right-hand
    side [β·v | β·γ·k] and its solution u | w, 2·Hv·(Dv + Dk); the chunk scan's inputs (u, w and
    the decayed q, k), Hv·(Dv + 3·Dk); the in-chunk C x C matrices (the decays γ, k·kᵀ, the solve's
    matrix and its inverse, the scores q·kᵀ·γ), 5·Hv·C; the scan's state at every chunk,
    Hv·Dk·Dv / C;
  and the input projection's output q|k|v|z|b|a in the compute dtype, Hk·(2·Dk + 2·G·Dv) + 2·Hv.
  Every linear layer's with remat_policy=none (nothing is recomputed), else the one layer's being
  differentiated. Checked against XLA's buffers for a v5e (benchmarks/tpu_aot.py; the family rows
  next2k / next8k of benchmarks/tpu_family_rows.py): at the step's peak, inside a linear layer's
  backward, the arrays above are live beside the MoE's token copies."""
  linear = sum(k.mixer == LINEAR for k in layer_kinds(cfg))
  if not linear:
    return 0
  Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
  Dk, Dv, C = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_chunk_size
  G = Hv // Hk
  X = 2 * Dk + G * Dv
  fp32 = (2 * Hk * X + 2 * Hv * (2 * Dk + Dv) + 2 * Hv * (Dv + Dk) + Hv * (Dv + 3 * Dk)
          + 5 * Hv * C + Hv * Dk * Dv / C)
  projection = Hk * (2 * Dk + 2 * G * Dv) + 2 * Hv
  tokens = math.ceil(sequences) * math.ceil(seq_len / C) * C
  per_layer = tokens * (fp32 * 4 + projection * jnp.dtype(cfg.compute_dtype).itemsize)
  layers = linear if cfg.remat_policy == "none" else 1
  return int(per_layer * layers)


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
    activation_bytes=linear_layer_bytes,
    decode_cache=decode_cache,
    hf_maps={"qwen3_next": hf_map},
)
