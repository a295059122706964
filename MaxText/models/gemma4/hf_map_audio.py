"""Hugging Face Gemma 4's audio tower (`Gemma4ForConditionalGeneration`: `model.audio_tower.*`;
config `audio_config`) ↔ our `AudioTower` (MaxText/models/gemma4/audio.py), paths below the
tower's root. (Its embedder `model.embed_audio.*` is the text model's, mapped with it.)

Rows of the name map (layouts: `in_rank`, see MaxText/models/name_map.py):
  subsample_conv_projection.layer{0,1}.conv.weight [C, C', 3, 3]   subsample/conv{0,1} (as is)
  subsample_conv_projection.layer{0,1}.norm.weight                 subsample/norm{0,1}
  subsample_conv_projection.input_proj_linear.weight [D, M/4·C1]   subsample/proj/kernel
  layers.{i}.feed_forward{1,2}.ffw_layer_{1,2}.linear.weight       ff{1,2}/{up,down}/kernel
  layers.{i}.self_attn.{q,k,v}_proj.linear.weight [H·E, D]         attn/{query,key,value}/kernel [D, H, E]
  layers.{i}.self_attn.post.linear.weight [D, H·E]                 attn/out/kernel [H, E, D]
  layers.{i}.self_attn.relative_k_proj.weight, per_dim_scale       attn/relative_key/kernel, attn/per_dim_scale
  layers.{i}.lconv1d.linear_{start,end}.linear.weight              lconv/{start,end}/kernel
  layers.{i}.lconv1d.depthwise_conv1d.weight [D, 1, K]             lconv/conv (as is)
  layers.{i}.{norm_pre_attn,norm_post_attn,norm_out}.weight        attn_norm, post_attn_norm, out_norm
  the clipped linears' input_min/input_max/output_min/output_max   .../{input,output}_{min,max} (scalars)
  output_proj.weight / .bias                                       output_proj/kernel, output_bias
(the norms' `weight` ↔ our `scale`; every HF name above is under `model.audio_tower.`). The relative position table and the logit cap are not parameters (HF keeps
them as non-persistent buffers).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

from MaxText.models.gemma4.audio import AudioTower, has_audio, layer_location, problems
from MaxText.models.gemma4.keys import Keys
from MaxText.models.model_config import ModelConfig
from MaxText.models.name_map import LayerGroup, NameMap, Rule

TOWER = "model.audio_tower."
_BOUNDS = ("input_min", "input_max", "output_min", "output_max")


def _clipped(ours: str, hf: str, in_rank: int = 1) -> tuple[Rule, ...]:
  """A clipped linear: its kernel and its four bounds."""
  return (Rule(f"{ours}/kernel", f"{hf}.linear.weight", in_rank=in_rank),
          *(Rule(f"{ours}/{b}", f"{hf}.{b}") for b in _BOUNDS))


_S = TOWER + "subsample_conv_projection."
GLOBAL_RULES: tuple[Rule, ...] = (
    Rule("subsample/conv0", _S + "layer0.conv.weight"),
    Rule("subsample/norm0", _S + "layer0.norm.weight"),
    Rule("subsample/conv1", _S + "layer1.conv.weight"),
    Rule("subsample/norm1", _S + "layer1.norm.weight"),
    Rule("subsample/proj/kernel", _S + "input_proj_linear.weight", in_rank=1),
    Rule("output_proj/kernel", TOWER + "output_proj.weight", in_rank=1),
    Rule("output_bias", TOWER + "output_proj.bias"),
)

_L = TOWER + "layers.{i}."


def _feed_forward(n: int) -> tuple[Rule, ...]:
  hf = f"{_L}feed_forward{n}."
  return (Rule(f"ff{n}/pre_norm/scale", hf + "pre_layer_norm.weight"),
          Rule(f"ff{n}/post_norm/scale", hf + "post_layer_norm.weight"),
          *_clipped(f"ff{n}/up", hf + "ffw_layer_1"),
          *_clipped(f"ff{n}/down", hf + "ffw_layer_2"))


LAYER_RULES: tuple[Rule, ...] = (
    *_feed_forward(1),
    *_feed_forward(2),
    *_clipped("attn/query", _L + "self_attn.q_proj"),
    *_clipped("attn/key", _L + "self_attn.k_proj"),
    *_clipped("attn/value", _L + "self_attn.v_proj"),
    *_clipped("attn/out", _L + "self_attn.post", in_rank=2),
    Rule("attn/relative_key/kernel", _L + "self_attn.relative_k_proj.weight", in_rank=1),
    Rule("attn/per_dim_scale", _L + "self_attn.per_dim_scale"),
    Rule("attn_norm/scale", _L + "norm_pre_attn.weight"),
    Rule("post_attn_norm/scale", _L + "norm_post_attn.weight"),
    Rule("out_norm/scale", _L + "norm_out.weight"),
    Rule("lconv/pre_norm/scale", _L + "lconv1d.pre_layer_norm.weight"),
    Rule("lconv/conv_norm/scale", _L + "lconv1d.conv_norm.weight"),
    *_clipped("lconv/start", _L + "lconv1d.linear_start"),
    *_clipped("lconv/end", _L + "lconv1d.linear_end"),
    Rule("lconv/conv", _L + "lconv1d.depthwise_conv1d.weight"),
)


def _check(mcfg: ModelConfig) -> None:
  if not has_audio(mcfg):
    raise ValueError("audio_hidden_size=0: the model has no audio tower to convert")
  bad = problems(mcfg)
  if bad:
    raise ValueError("; ".join(f"{k}: {p}" for k, p in bad))


NAME_MAP = NameMap(GLOBAL_RULES, (), layer_location, AudioTower, check=_check,
                   more_layers=(LayerGroup(LAYER_RULES, layer_location,
                                           lambda mcfg: mcfg.audio_num_layers),))
hf_names, params_to_hf = NAME_MAP.hf_names, NAME_MAP.params_to_hf


def is_audio_name(name: str) -> bool:
  """Whether an HF tensor is the audio tower's."""
  return name.startswith(TOWER)


class _AudioView(Mapping):
  """The audio tower's tensors of a whole multimodal checkpoint."""

  def __init__(self, hf_state: Mapping[str, Any]):
    self._state = hf_state
    self._names = [k for k in hf_state if is_audio_name(k)]

  def __getitem__(self, name: str):
    if not is_audio_name(name):
      raise KeyError(name)
    return self._state[name]

  def __iter__(self):
    return iter(self._names)

  def __len__(self) -> int:
    return len(self._names)


def hf_to_params(hf_state: Mapping[str, np.ndarray], mcfg: ModelConfig) -> dict:
  """The audio tensors of an HF checkpoint (other tensors are left to their maps) → the
  `AudioTower`'s pure-dict params. Strict over the audio names: a missing one, a wrong shape or
  one left over raises ValueError naming it."""
  return NAME_MAP.hf_to_params(_AudioView(hf_state), mcfg)


# ---- config --------------------------------------------------------------------------------------
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
_HF_ACTIVATION = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}


def config_from_hf(hf_config: Mapping[str, Any]) -> dict[str, Any]:
  """A multimodal HF Gemma 4 config (its `audio_config`; absent or null: no tower) → our audio
  keys."""
  audio = hf_config.get("audio_config")
  if not audio:
    return {"audio_hidden_size": 0}
  audio = dict(audio)
  act = audio.get("hidden_act", "silu")
  if act not in _ACTIVATIONS:
    raise ValueError(f"audio_config.hidden_act={act!r}: only {sorted(_ACTIVATIONS)}")
  channels = [int(c) for c in audio.get("subsampling_conv_channels", (128, 32))]
  return {
      "audio_hidden_size": int(audio.get("hidden_size", 1024)),
      "audio_num_layers": int(audio.get("num_hidden_layers", 12)),
      "audio_num_heads": int(audio.get("num_attention_heads", 8)),
      "audio_subsampling_channels": channels,
      "audio_conv_kernel_size": int(audio.get("conv_kernel_size", 5)),
      "audio_residual_weight": float(audio.get("residual_weight", 0.5)),
      "audio_chunk_size": int(audio.get("attention_chunk_size", 12)),
      "audio_context_left": int(audio.get("attention_context_left", 13)),
      "audio_context_right": int(audio.get("attention_context_right", 0)),
      "audio_logit_cap": float(audio.get("attention_logit_cap", 50.0)),
      "audio_invalid_logit": float(audio.get("attention_invalid_logits_value", -1e9)),
      "audio_clipped_linears": bool(audio.get("use_clipped_linears", True)),
      "audio_norm_epsilon": float(audio.get("rms_norm_eps", 1e-6)),
      "audio_gradient_clipping": float(audio.get("gradient_clipping", 1e10)),
      "audio_output_dim": int(audio.get("output_proj_dims", 1536)),
      "audio_activation": _ACTIVATIONS[act],
  }


# the audio tower's keys (what a `gemma4` config.json's audio_config holds)
AUDIO_KEYS = frozenset(f.name for f in dataclasses.fields(Keys) if f.name.startswith("audio_"))


def config_to_hf(cfg: Any) -> dict[str, Any] | None:
  """Our config (`Config`, `ModelConfig` or a dict of our keys) → HF `audio_config` (a
  `Gemma4AudioConfig(**d)`), None without an audio tower."""
  get = cfg.__getitem__ if isinstance(cfg, Mapping) else lambda k: getattr(cfg, k)
  if not int(get("audio_hidden_size")):
    return None
  return {
      "model_type": "gemma4_audio",
      "hidden_size": int(get("audio_hidden_size")),
      "num_hidden_layers": int(get("audio_num_layers")),
      "num_attention_heads": int(get("audio_num_heads")),
      "hidden_act": _HF_ACTIVATION[get("audio_activation")],
      "subsampling_conv_channels": [int(c) for c in get("audio_subsampling_channels")],
      "conv_kernel_size": int(get("audio_conv_kernel_size")),
      "residual_weight": float(get("audio_residual_weight")),
      "attention_chunk_size": int(get("audio_chunk_size")),
      "attention_context_left": int(get("audio_context_left")),
      "attention_context_right": int(get("audio_context_right")),
      "attention_logit_cap": float(get("audio_logit_cap")),
      "attention_invalid_logits_value": float(get("audio_invalid_logit")),
      "use_clipped_linears": bool(get("audio_clipped_linears")),
      "rms_norm_eps": float(get("audio_norm_epsilon")),
      "gradient_clipping": float(get("audio_gradient_clipping")),
      "output_proj_dims": int(get("audio_output_dim")),
  }
