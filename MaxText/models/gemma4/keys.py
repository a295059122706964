"""The model keys only the Gemma 4 family reads (full-layer geometry, kv sharing, per-layer
input embeddings, the logit soft cap).

Composed into the one schema like every family's `keys.py` (docs/architecture.md, the family
section).
"""
from __future__ import annotations

from dataclasses import dataclass

from MaxText.config.spec import Section, key
from MaxText.config.tools import CONVERT, MODEL_TOOLS

SECTION = Section(section="model: gemma4 (MaxText/models/gemma4/keys.py)",
                  section_tools=(*MODEL_TOOLS, *CONVERT))


@dataclass(frozen=True, kw_only=True)
class Keys:
  attention_scale: float = key(0.0, "multiplier of q.k; 0 = 1/sqrt(head_dim)", min=0, model=True,
                               **SECTION)
  global_head_dim: int = key(0, "head width on full layers (0 = head_dim)", min=0, model=True)
  global_num_kv_heads: int = key(0, "kv heads on full layers (0 = num_kv_heads)", min=0,
                                 model=True)
  global_rope_theta: float = key(0.0, "RoPE base on full layers (0 = rope_theta)", min=0,
                                 model=True)
  global_rope_fraction: float = key(
      1.0, "share of channel pairs rotated on full layers (proportional RoPE)", gt=0, max=1,
      model=True)
  attention_k_eq_v: bool = key(False, "full layers have no value projection: V = the raw key "
                               "projection", model=True)
  num_kv_shared_layers: int = key(0, "the last N layers reuse K/V of the last earlier layer of "
                                  "their kind", min=0, model=True)
  double_wide_mlp_on_shared: bool = key(False, "the kv-shared layers have a 2 x mlp_dim MLP",
                                        model=True)
  per_layer_input_dim: int = key(0, "per-layer input embeddings (PLE) width; 0 = off", min=0,
                                 model=True)
  per_layer_input_vocab_size: int = key(0, "rows of the PLE table (0 = vocab_size)", min=0,
                                        model=True)
  final_logit_softcap: float = key(0.0, "logits = c * tanh(logits / c) before the loss; 0 = off",
                                   min=0, model=True)

  vision_layers: int = key(
      0, "vision encoder layers; 0 = no vision tower (a text model)", min=0, model=True,
      section="model: gemma4 vision tower and multimodal inputs (MaxText/models/gemma4/vision.py, "
      "towers.py; HF vision_config)", section_tools=(*MODEL_TOOLS, *CONVERT))
  vision_emb_dim: int = key(768, "vision encoder width", min=1, model=True)
  vision_mlp_dim: int = key(3072, "vision encoder MLP width", min=1, model=True)
  vision_num_heads: int = key(12, "vision encoder query heads", min=1, model=True)
  vision_num_kv_heads: int = key(12, "vision encoder kv heads", min=1, model=True)
  vision_head_dim: int = key(64, "vision encoder head width (2-D RoPE: a multiple of 4)", min=4,
                             model=True)
  vision_patch_size: int = key(16, "image patch side in pixels", min=1, model=True)
  vision_position_embedding_size: int = key(10240, "rows of each axis of the learned 2-D patch "
                                            "position table", min=1, model=True)
  vision_pooling_kernel: int = key(3, "k: soft tokens are means of k x k patch blocks", min=1,
                                   model=True)
  vision_rope_theta: float = key(100.0, "RoPE base of the vision encoder (axial 2-D)", gt=0,
                                 model=True)
  vision_norm_epsilon: float = key(1e-6, "RMSNorm epsilon of the vision encoder and its "
                                   "embedder", gt=0, model=True)
  vision_standardize: bool = key(False, "soft tokens standardized by frozen std_bias / std_scale",
                                 model=True)
  vision_clipped_linears: bool = key(False, "vision projections clamp inputs and outputs to "
                                     "bounds carried with their weights", model=True)
  mm_bidirectional_vision: bool = key(False, "an image's tokens attend to each other both ways on "
                                      "sliding layers (transformers' "
                                      'use_bidirectional_attention="vision")', model=True)
  freeze_vision_encoder: bool = key(True, "training leaves the vision tower and its embedder "
                                    "unchanged", model=True, arch=False)
  mm_pad_token_id: int = key(0, "the id placeholders are embedded as (the text config's "
                             "pad_token_id)", min=0, model=True)
  image_token_id: int = key(258880, "image soft-token placeholder id", min=0, model=True)
  boi_token_id: int = key(255999, "begin-of-image id", min=0, model=True)
  eoi_token_id: int = key(258882, "end-of-image id", min=0, model=True)
  video_token_id: int = key(258884, "video soft-token placeholder id (embedded as pad)", min=0,
                            model=True)
  audio_token_id: int = key(258881, "audio soft-token placeholder id", min=0, model=True)
  boa_token_id: int = key(256000, "begin-of-audio id", min=0, model=True)
  eoa_token_id: int = key(258883, "end-of-audio id (transformers: eoa_token_index)", min=0,
                          model=True)
  image_soft_tokens: int = key(280, "soft tokens per image at most (the processor's "
                               "max_soft_tokens: its patch budget is this x k^2)", min=1,
                               model=True, arch=False)
  images_per_sequence: float = key(0.0, "images a training sequence carries on average: what "
                                   "FLOPs / MFU and the memory pre-flight count of the vision "
                                   "tower", min=0, model=True, arch=False)

  # ---- the audio tower (MaxText/models/gemma4/audio.py; HF `audio_config`) ----------------------
  audio_hidden_size: int = key(
      0, "audio tower (conformer) width; 0 = no audio tower", min=0, model=True,
      section="model: gemma4 audio tower (MaxText/models/gemma4/audio.py; HF audio_config)",
      section_tools=(*MODEL_TOOLS, *CONVERT))
  audio_num_layers: int = key(12, "conformer layers of the audio tower", min=1, model=True)
  audio_num_heads: int = key(8, "attention heads of the audio tower (head width = "
                             "audio_hidden_size / heads)", min=1, model=True)
  audio_subsampling_channels: list[int] = key(
      [128, 32], "channels of the two stride-2 3x3 convolutions that subsample the log-mel "
      "frames 4x in time and frequency (the first also fixes the mel bins: channels[0] / 4 "
      "bins are left after them)", model=True)
  audio_conv_kernel_size: int = key(5, "width of the light convolution (depthwise, causal)",
                                    min=1, model=True)
  audio_residual_weight: float = key(0.5, "the feed-forward blocks' output is scaled by this "
                                     "before the residual", model=True)
  audio_chunk_size: int = key(12, "chunked local attention: queries per chunk", min=1,
                              model=True)
  audio_context_left: int = key(13, "chunked local attention: left context (HF "
                                "attention_context_left; a query sees itself and the "
                                "context_left - 2 frames before it)", min=1, model=True)
  audio_context_right: int = key(0, "chunked local attention: frames after a query it sees",
                                 min=0, model=True)
  audio_logit_cap: float = key(50.0, "attention logits = c * tanh(logits / c)", gt=0, model=True)
  audio_invalid_logit: float = key(-1e9, "the logit of a masked (padding or out-of-window) key",
                                   model=True)
  audio_clipped_linears: bool = key(True, "the tower's projections clamp their input and output "
                                    "to per-layer bounds from the checkpoint (±inf at init)",
                                    model=True)
  audio_norm_epsilon: float = key(1e-6, "epsilon of the subsampling, light-convolution and "
                                  "embedder norms (the other norms: 1e-6, as HF)", gt=0,
                                  model=True)
  audio_gradient_clipping: float = key(1e10, "the conformer clamps activations to ± this",
                                       gt=0, model=True)
  audio_output_dim: int = key(1536, "width of the tower's output projection (what the audio "
                              "embedder projects to emb_dim)", min=1, model=True)
  audio_activation: str = key("silu", "activation of the conformer's feed-forward and light "
                              "convolution", choices=("silu", "gelu_tanh"), model=True)
  freeze_audio_encoder: bool = key(True, "training leaves the audio tower and its embedder "
                                   "unchanged", model=True, arch=False)
  audio_seconds_per_sequence: float = key(
      0.0, "seconds of audio a training sequence carries on average: what FLOPs / MFU and the "
      "memory pre-flight count of the audio tower (100 feature frames a second, 25 soft tokens)",
      min=0, model=True, arch=False)
