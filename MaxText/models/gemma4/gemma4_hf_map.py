"""Hugging Face multimodal Gemma 4 (`gemma4`, `Gemma4ForConditionalGeneration`) ↔ our `gemma4`
family with its encoder towers (towers.py).

The text model's rows are those of hf_map.py (`gemma4_text`) under `model.language_model.`; the
LM head stays `lm_head.weight` (tied: left out, as save_pretrained does). The vision tower
(vision.py) and its embedder:
  model.vision_tower.patch_embedder.input_proj.weight [Dv, C]     vision/patch_proj/kernel [C, Dv]
  model.vision_tower.patch_embedder.position_embedding_table      vision/pos_table [2, Npos, Dv]
  model.vision_tower.encoder.layers.{i}.self_attn.q_proj.linear.weight [Hv*Ev, Dv]
                                                 vision/encoder/.../attn/query/kernel [Dv, Hv, Ev]
    (k/v/o_proj likewise; q_norm/k_norm weights; input_/post_attention_/pre_feedforward_/
    post_feedforward_layernorm; mlp.gate/up/down_proj.linear.weight)
    with use_clipped_linears each projection's input_min/input_max/output_min/output_max [] ↔
    .../<projection>/input_min ... (frozen)
  model.vision_tower.std_bias / std_scale [Dv]    vision/std_bias / std_scale   (standardize)
  model.embed_vision.embedding_projection.weight [D, Dv]    embed_vision/proj/kernel [Dv, D]
The audio tower's rows are hf_map_audio.py's under `audio/` (`model.audio_tower.*`), and its
embedder:
  model.embed_audio.embedding_projection.weight [D, O]      embed_audio/proj/kernel [O, D]
A tower the config does not have is skipped on import, and the export then writes its
`vision_config` / `audio_config` null. `config_from_hf` reads the vision and audio configs, the
placeholder and marker ids, `use_bidirectional_attention` ("vision" or null) and the text
config's `pad_token_id`; without any tower the model is the text model (`hf_model_type` =
`gemma4_text`, as before).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from MaxText.models.gemma4 import audio, hf_map, hf_map_audio
from MaxText.models.gemma4.model import Transformer, layer_kinds, layer_location
from MaxText.models.gemma4.towers import towers_of
from MaxText.models.gemma4 import vision
from MaxText.models.model_config import ModelConfig
from MaxText.models.name_map import FolderMap, LayerGroup, NameMap, Rule, check_representable

PREFIX = "model.language_model."


def _prefixed(rule: Rule) -> Rule:
  hf = PREFIX + rule.hf[len("model."):] if rule.hf.startswith("model.") else rule.hf
  return dataclasses.replace(rule, hf=hf)


_V = "model.vision_tower."
_VL = _V + "encoder.layers.{i}."
VISION_GLOBAL_RULES: tuple[Rule, ...] = (
    Rule("vision/patch_proj/kernel", _V + "patch_embedder.input_proj.weight", in_rank=1),
    Rule("vision/pos_table", _V + "patch_embedder.position_embedding_table"),
    Rule("vision/std_bias", _V + "std_bias"),
    Rule("vision/std_scale", _V + "std_scale"),
    Rule("embed_vision/proj/kernel", "model.embed_vision.embedding_projection.weight", in_rank=1),
)
_PROJECTIONS = {"attn/query": ("self_attn.q_proj", 1), "attn/key": ("self_attn.k_proj", 1),
                "attn/value": ("self_attn.v_proj", 1), "attn/out": ("self_attn.o_proj", 2),
                "mlp/gate": ("mlp.gate_proj", 1), "mlp/up": ("mlp.up_proj", 1),
                "mlp/down": ("mlp.down_proj", 1)}
VISION_LAYER_RULES: tuple[Rule, ...] = (
    Rule("attn_norm/scale", _VL + "input_layernorm.weight"),
    Rule("post_attn_norm/scale", _VL + "post_attention_layernorm.weight"),
    Rule("mlp_norm/scale", _VL + "pre_feedforward_layernorm.weight"),
    Rule("post_mlp_norm/scale", _VL + "post_feedforward_layernorm.weight"),
    Rule("attn/query_norm/scale", _VL + "self_attn.q_norm.weight"),
    Rule("attn/key_norm/scale", _VL + "self_attn.k_norm.weight"),
    *(Rule(f"{ours}/kernel", f"{_VL}{hf}.linear.weight", in_rank=rank)
      for ours, (hf, rank) in _PROJECTIONS.items()),
    *(Rule(f"{ours}/{bound}", f"{_VL}{hf}.{bound}") for ours, (hf, _) in _PROJECTIONS.items()
      for bound in ("input_min", "input_max", "output_min", "output_max")),
)
# the prefixes of each tower's tensors (skipped when the config lacks that tower)
TOWER_PREFIXES = {"vision": (_V, "model.embed_vision."),
                  "audio": ("model.audio_tower.", "model.embed_audio.")}



def _under_audio(rule: Rule) -> Rule:
  return dataclasses.replace(rule, ours="audio/" + rule.ours)


# the audio tower's rows (hf_map_audio.py, relative to the tower's root) under `audio/` (its
# layers' through `_audio_location`), and its embedder's projection
AUDIO_GLOBAL_RULES: tuple[Rule, ...] = (
    *(_under_audio(r) for r in hf_map_audio.GLOBAL_RULES),
    Rule("embed_audio/proj/kernel", "model.embed_audio.embedding_projection.weight", in_rank=1),
)


def _audio_location(mcfg: ModelConfig, i: int) -> tuple[tuple, int | None]:
  path, index = audio.layer_location(mcfg, i)
  return ("audio", *path), index


NAME_MAP = NameMap(
    tuple(_prefixed(r) for r in hf_map.GLOBAL_RULES) + VISION_GLOBAL_RULES + AUDIO_GLOBAL_RULES,
    tuple(_prefixed(r) for r in hf_map.LAYER_RULES), layer_location, Transformer,
    ours_only=("router_bias",), check=lambda mcfg: config_to_hf(mcfg),
    embedding_name=PREFIX + "embed_tokens.weight", tied_head_name="lm_head.weight",
    more_layers=(LayerGroup(VISION_LAYER_RULES, vision.layer_location,
                            lambda c: c.vision_layers),
                 LayerGroup(hf_map_audio.LAYER_RULES, _audio_location,
                            lambda c: c.audio_num_layers if audio.has_audio(c) else 0)))
_SHARED_KV = re.compile(re.escape(PREFIX) +
                        r"layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.weight$")

hf_names, params_to_hf = NAME_MAP.hf_names, NAME_MAP.params_to_hf


def _ignore(mcfg: ModelConfig) -> Callable[[str], bool]:
  """The tensors a model with towers skips: the towers the config lacks, and kv-shared layers'
  extra K/V (ignored as transformers does)."""
  shared = {i for i, k in enumerate(layer_kinds(mcfg)) if k.kv_shared}
  have = {t.name for t in towers_of(mcfg)}
  skipped = tuple(p for name, ps in TOWER_PREFIXES.items() if name not in have for p in ps)

  def ignore(name: str) -> bool:
    m = _SHARED_KV.match(name)
    return (bool(m) and int(m.group(1)) in shared) or name.startswith(skipped)
  return ignore


def hf_to_params(hf_state: Mapping[str, np.ndarray], mcfg: ModelConfig) -> dict:
  """HF multimodal tensors → our params: the towers the config has (others skipped); kv-shared
  layers' extra K/V ignored as transformers does."""
  if not towers_of(mcfg):
    return hf_map.hf_to_params(hf_state, mcfg)
  return NAME_MAP.hf_to_params(hf_state, mcfg, ignore=_ignore(mcfg))


def folder_map(names: Iterable[str], mcfg: ModelConfig) -> FolderMap:
  """What `hf_to_params` reads of a folder holding tensors `names`, a box at a time."""
  if not towers_of(mcfg):
    return hf_map.folder_map(names, mcfg)
  return FolderMap(NAME_MAP, ignore=_ignore(mcfg))


# ---- config --------------------------------------------------------------------------------------
_IDS = {"image_token_id": "image_token_id", "boi_token_id": "boi_token_id",
        "eoi_token_id": "eoi_token_id", "video_token_id": "video_token_id",
        "audio_token_id": "audio_token_id", "boa_token_id": "boa_token_id",
        "eoa_token_id": "eoa_token_index"}          # ours → Gemma4Config's field
_ID_DEFAULTS = {"image_token_id": 258880, "boi_token_id": 255999, "eoi_token_id": 258882,
                "video_token_id": 258884, "audio_token_id": 258881, "boa_token_id": 256000,
                "eoa_token_id": 258883}
VISION_KEYS = ("vision_layers", "vision_emb_dim", "vision_mlp_dim", "vision_num_heads",
               "vision_num_kv_heads", "vision_head_dim", "vision_patch_size",
               "vision_position_embedding_size", "vision_pooling_kernel", "vision_rope_theta",
               "vision_norm_epsilon", "vision_standardize", "vision_clipped_linears")
REPRESENTS = (hf_map.REPRESENTS | set(VISION_KEYS) | set(_IDS) | set(hf_map_audio.AUDIO_KEYS)
              | {"mm_bidirectional_vision", "mm_pad_token_id"})


def _vision_from_hf(v: Mapping[str, Any]) -> dict[str, Any]:
  if v.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
    raise ValueError(f"vision_config.hidden_activation={v['hidden_activation']!r}: only "
                     f"gelu_pytorch_tanh")
  if v.get("attention_bias"):
    raise ValueError("vision_config.attention_bias=true is not supported")
  rope = dict(v.get("rope_parameters") or {})
  if rope.get("rope_type", "axial") not in ("axial", "default"):   # (hub files write "default")
    raise ValueError(f"vision_config.rope_parameters.rope_type={rope['rope_type']!r}: only the "
                     f"axial 2-D RoPE")
  return {
      "vision_layers": int(v.get("num_hidden_layers", 16)),
      "vision_emb_dim": int(v.get("hidden_size", 768)),
      "vision_mlp_dim": int(v.get("intermediate_size", 3072)),
      "vision_num_heads": int(v.get("num_attention_heads", 12)),
      "vision_num_kv_heads": int(v.get("num_key_value_heads", 12)),
      "vision_head_dim": int(v.get("head_dim", 64)),
      "vision_patch_size": int(v.get("patch_size", 16)),
      "vision_position_embedding_size": int(v.get("position_embedding_size", 10240)),
      "vision_pooling_kernel": int(v.get("pooling_kernel_size", 3)),
      "vision_rope_theta": float(rope.get("rope_theta", 100.0)),
      "vision_norm_epsilon": float(v.get("rms_norm_eps", 1e-6)),
      "vision_standardize": bool(v.get("standardize", False)),
      "vision_clipped_linears": bool(v.get("use_clipped_linears", False)),
  }


def config_from_hf(hf_config: Mapping[str, Any]) -> dict[str, Any]:
  """HF `gemma4` config (config.json or `to_dict()`) → our keys: the text model's
  (hf_map.config_from_hf), its vision tower, the ids and the bidirectional flag."""
  if hf_config.get("model_type") != "gemma4":
    return hf_map.config_from_hf(hf_config)
  text = dict(hf_config.get("text_config") or {})
  bidirectional = text.pop("use_bidirectional_attention", None)
  if bidirectional not in (None, "vision"):
    raise ValueError(f"use_bidirectional_attention={bidirectional!r} is not supported (only "
                     f"'vision' or null)")
  out = hf_map.config_from_hf({**text, "model_type": "gemma4_text"})
  vision_cfg, audio_cfg = hf_config.get("vision_config"), hf_config.get("audio_config")
  if not vision_cfg and not audio_cfg:
    return out          # no tower: the text model
  out.update(_vision_from_hf(vision_cfg) if vision_cfg else {"vision_layers": 0})
  out.update(hf_map_audio.config_from_hf(hf_config))
  out.update({ours: int(given if (given := hf_config.get(theirs)) is not None
                        else _ID_DEFAULTS[ours]) for ours, theirs in _IDS.items()})
  out.update(hf_model_type="gemma4", mm_bidirectional_vision=bidirectional == "vision",
             mm_pad_token_id=int(text.get("pad_token_id", 0) or 0))
  return out


def config_to_hf(cfg: Any) -> dict[str, Any]:
  """Our config (`Config`, `ModelConfig` or a dict of our keys) → an HF `gemma4` config dict
  (`transformers.Gemma4Config(**d)`): the text config of hf_map.config_to_hf, the vision config
  (null without a tower), the ids."""
  get = cfg.__getitem__ if isinstance(cfg, Mapping) else lambda k: getattr(cfg, k)
  if not isinstance(cfg, Mapping):
    check_representable(cfg, REPRESENTS, "gemma4")
  text_keys = {k: get(k) for k in hf_map.REPRESENTS | {"decoder_block", "mlp_activation"}}
  text = hf_map.config_to_hf(text_keys)
  text.pop("architectures", None)
  text.update(use_bidirectional_attention="vision" if get("mm_bidirectional_vision") else None,
              pad_token_id=int(get("mm_pad_token_id")))
  vision_cfg = None
  if int(get("vision_layers")):
    vision_cfg = {
        "model_type": "gemma4_vision",
        "num_hidden_layers": int(get("vision_layers")),
        "hidden_size": int(get("vision_emb_dim")),
        "intermediate_size": int(get("vision_mlp_dim")),
        "num_attention_heads": int(get("vision_num_heads")),
        "num_key_value_heads": int(get("vision_num_kv_heads")),
        "head_dim": int(get("vision_head_dim")),
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": float(get("vision_norm_epsilon")),
        "attention_bias": False,
        "rope_parameters": {"rope_type": "axial", "rope_theta": float(get("vision_rope_theta"))},
        "pooling_kernel_size": int(get("vision_pooling_kernel")),
        "patch_size": int(get("vision_patch_size")),
        "position_embedding_size": int(get("vision_position_embedding_size")),
        "use_clipped_linears": bool(get("vision_clipped_linears")),
        "standardize": bool(get("vision_standardize")),
    }
  return {
      "architectures": ["Gemma4ForConditionalGeneration"],
      "model_type": "gemma4",
      "text_config": text,
      "vision_config": vision_cfg,
      "audio_config": hf_map_audio.config_to_hf(cfg),
      **{theirs: int(get(ours)) for ours, theirs in _IDS.items()},
      "tie_word_embeddings": bool(get("tie_word_embeddings")),
  }
