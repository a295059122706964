"""The `gemma4` family (Gemma 4: the text model and its encoder towers, towers.py): what generic
code knows of it (MaxText/models/family.py)."""
from __future__ import annotations

import jax.numpy as jnp

from MaxText.layers.moe import MoETerms, active_matmul_params
from MaxText.metrics.flops import (FlopCount, attention_pairs, attention_params,
                                   attention_score_flops, gated_mlp_params)
from MaxText.models.family import (COMMON_KEYS, ROUTED_EXPERT_KEYS, Family, Problems,
                                   routed_expert_problems)
from MaxText.models.gemma4 import audio, audio_layers, gemma4_hf_map, hf_map, towers, vision
from MaxText.models.gemma4.model import (Transformer, attention_types, decode_cache,
                                         first_kv_shared_layer, head_dim_of, kv_heads_of,
                                         layer_kinds)
from MaxText.models.gemma4.keys import Keys
from MaxText.models.model_config import ModelConfig

# the schema's shared keys it implements; its own (keys.py) are supported through keys=Keys
GEMMA4_KEYS = frozenset({
    "mlp_activation", "use_qk_norm", "tie_word_embeddings", "attention_pattern", "sliding_window",
    "weight_quant_vocab"})


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
  return problems + vision_problems(cfg) + audio.problems(cfg) + placeholder_problems(cfg)


def vision_problems(cfg: ModelConfig) -> Problems:
  if not vision.has_vision(cfg):
    return []
  problems = []
  if cfg.vision_num_heads % cfg.vision_num_kv_heads:
    problems.append(("vision_num_kv_heads", f"vision_num_heads={cfg.vision_num_heads} is not a "
                     f"multiple of vision_num_kv_heads={cfg.vision_num_kv_heads}"))
  if cfg.vision_head_dim % 4:
    problems.append(("vision_head_dim", f"{cfg.vision_head_dim}: 2-D RoPE rotates two halves of "
                     f"even width, so it must be a multiple of 4"))
  return problems


def placeholder_problems(cfg: ModelConfig) -> Problems:
  """A model with a tower: its placeholder ids inside the vocabulary."""
  outside = [i for i in towers.placeholder_ids(cfg) if i >= cfg.vocab_size]
  if outside:
    return [("image_token_id", f"placeholder ids {outside} are outside the vocabulary of "
             f"{cfg.vocab_size}")]
  return []


def vision_patches(cfg: ModelConfig) -> int:
  """The patches of one image as the tower runs it (the processor pads to its budget)."""
  return cfg.image_soft_tokens * cfg.vision_pooling_kernel ** 2


def vision_forward_flops(cfg: ModelConfig) -> float:
  """One image through the tower and its embedder, forward: patch projection, every layer's
  projections and MLP over the padded patches, attention over all patch pairs, the embedder over
  the soft tokens (pooling and norms are elementwise)."""
  P, M = vision_patches(cfg), cfg.image_soft_tokens
  Dv, H, K, E = (cfg.vision_emb_dim, cfg.vision_num_heads, cfg.vision_num_kv_heads,
                 cfg.vision_head_dim)
  per_layer = attention_params(Dv, H, K, E) + gated_mlp_params(Dv, cfg.vision_mlp_dim)
  matmul = 3 * cfg.vision_patch_size ** 2 * Dv + cfg.vision_layers * per_layer
  attention = cfg.vision_layers * attention_score_flops(float(P) * P, H, E)
  return 2.0 * P * matmul + attention + 2.0 * M * Dv * cfg.emb_dim


AUDIO_FRAMES_PER_SECOND = 100     # the feature extractor's 10 ms hop
AUDIO_SUBSAMPLING = 4             # two stride-2 convolutions: 25 soft tokens a second


def audio_forward_flops(cfg: ModelConfig, seconds: float) -> float:
  """`seconds` of audio through the audio tower and its embedder, forward: the two subsampling
  convolutions (3x3, over frames x mel bins) and the projection to the tower's width, every
  conformer layer's projections (two 4x feed-forwards, q/k/v/out, the light convolution's gated
  start and end) and its depthwise convolution, the chunked attention (each query against its
  context's W keys, and the relative-position term), the output projection and the embedder."""
  if not audio.has_audio(cfg) or not seconds:
    return 0.0
  c0, c1 = cfg.audio_subsampling_channels
  D, O, K, W = (cfg.audio_hidden_size, cfg.audio_output_dim, cfg.audio_conv_kernel_size,
                audio_layers.context_width(cfg))
  S = seconds * AUDIO_FRAMES_PER_SECOND          # frames in
  T = S / AUDIO_SUBSAMPLING                      # soft tokens out
  M = c0                                         # mel bins in (c0 / 4 left after subsampling)
  subsample = 2 * 9 * c0 * (S / 2) * (M / 2) + 2 * 9 * c0 * c1 * T * (M / 4)
  subsample += 2 * T * (M // 4) * c1 * D
  per_layer = 2 * T * (23 * D * D + K * D) + 2 * T * (2 * W + W // 2 + 1) * D
  return subsample + cfg.audio_num_layers * per_layer + 2 * T * D * O + 2 * T * O * cfg.emb_dim


def towers_flops(cfg: ModelConfig) -> float:
  """A training step's tower FLOPs per sequence (`images_per_sequence` images,
  `audio_seconds_per_sequence` of audio): forward, and the backward (twice the forward) when the
  tower is trained; a frozen tower's soft tokens carry no gradient, so it runs forward only."""
  total = 0.0
  if vision.has_vision(cfg) and cfg.images_per_sequence:
    total += cfg.images_per_sequence * vision_forward_flops(cfg) * (
        1 if cfg.freeze_vision_encoder else 3)
  total += audio_forward_flops(cfg, cfg.audio_seconds_per_sequence) * (
      1 if cfg.freeze_audio_encoder else 3)
  return total


def frozen(cfg: ModelConfig) -> tuple[str, ...]:
  """The frozen towers and their embedders (freeze_vision_encoder, ...: towers.py)."""
  return tuple(name for t in towers.towers_of(cfg) if t.frozen(cfg)
               for name in (t.name, "embed_" + t.name))


def activation_bytes(cfg: ModelConfig, sequences: float, seq_len: int) -> int:
  """The towers' activations: the vision tower's and the audio tower's (below)."""
  return (vision_activation_bytes(cfg, sequences)
          + audio_activation_bytes(cfg, sequences))


def audio_activation_bytes(cfg: ModelConfig, sequences: float) -> int:
  """The audio tower's activations for `audio_seconds_per_sequence`: frozen, the subsampling's
  first feature map and one conformer layer's fp32 working set (projections, the 4x
  feed-forward, the chunked scores); trained, also every layer's input and (without remat) its
  intermediates."""
  if not audio.has_audio(cfg) or not cfg.audio_seconds_per_sequence:
    return 0
  c0, _ = cfg.audio_subsampling_channels
  D, H, W = cfg.audio_hidden_size, cfg.audio_num_heads, audio_layers.context_width(cfg)
  S = sequences * cfg.audio_seconds_per_sequence * AUDIO_FRAMES_PER_SECOND
  T = S / AUDIO_SUBSAMPLING
  scores = T * H * W
  working = (S / 2) * (c0 / 2) * c0 * 4 + T * 12 * D * 4 + 3 * scores * 4
  if cfg.freeze_audio_encoder:
    return int(working)
  c = jnp.dtype(cfg.compute_dtype).itemsize
  kept = T * D * c
  if cfg.remat_policy == "none":
    kept += T * 12 * D * c + scores * (4 + c)
  return int(cfg.audio_num_layers * kept + working)


def vision_activation_bytes(cfg: ModelConfig, sequences: float) -> int:
  """The vision tower's activations for `images_per_sequence` images per sequence: frozen, one
  layer's fp32 working set (nothing is kept for a backward pass); trained, also every layer's
  input and (without remat) its intermediates, as the text layers are counted."""
  if not vision.has_vision(cfg) or not cfg.images_per_sequence:
    return 0
  images = sequences * cfg.images_per_sequence
  P, Dv, H, E, F = (vision_patches(cfg), cfg.vision_emb_dim, cfg.vision_num_heads,
                    cfg.vision_head_dim, cfg.vision_mlp_dim)
  scores = images * H * P * P if cfg.attention == "dot_product" else 0
  working = images * P * (4 * Dv + 4 * H * E + 3 * F) * 4 + 3 * scores * 4
  if cfg.freeze_vision_encoder:
    return int(working)
  c = jnp.dtype(cfg.compute_dtype).itemsize
  kept = images * P * Dv * c
  if cfg.remat_policy == "none":
    kept += images * P * (4 * Dv + 4 * H * E + 3 * F) * c + scores * (4 + c)
  return int(cfg.vision_layers * kept + working)


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
  return FlopCount(matmul_params=params, attention_per_sequence=attention,
                   towers_per_sequence=towers_flops(cfg))


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
    frozen=frozen,
    activation_bytes=activation_bytes,
    decode_cache=decode_cache,
    media=towers.modalities,      # the towers' modalities: the tools take images for them
    # gemma4_text: the text model (Gemma4ForCausalLM); gemma4: with its towers
    hf_maps={"gemma4_text": hf_map, "gemma4": gemma4_hf_map},
)
