"""Gemma 4's audio tower: log-mel frames → the audio soft tokens (HF `Gemma4AudioModel`, the
Universal Speech Model conformer; the text model's `embed_audio` embedder, as for every tower,
is MaxText/models/gemma4/towers.py). Built from the `audio_*` keys (MaxText/models/gemma4/keys.py) when
`audio_hidden_size > 0`.

Conventions
  dimension letters: B clips, S input frames, M mel bins, T frames after subsampling (S / 4),
  D tower width, O the output projection's width (audio_output_dim), X the text width (emb_dim),
  C0/C1 the subsampling convolutions' channels. Parameters carry the tower's logical axes
  (audio_embed, audio_mlp, audio_heads, audio_conv) for the rules table.

  features [B, S, M], mask [B, S] (True = a real frame: the feature extractor's
  `input_features_mask`)
  → subsample: twice (frames zeroed where masked, a 3x3 stride-2 convolution without bias
    (kernels in HF's [out, in, 3, 3] layout), LayerNorm over channels with a scale and no bias,
    ReLU; the mask keeps every other frame) → [B, T, M/4 · C1] → D (no bias)
  → the conformer layers (audio_layers.py; one pattern stack: scanned, remat per layer) with the
    chunked attention's mask of the valid frames
  → output projection D → O (with a bias)           = HF audio_tower's last_hidden_state
  (the embedder `embed_audio`: scale-free RMSNorm with audio_norm_epsilon, O → X, no bias)
Only the frames valid after subsampling (`valid_BT`) are soft tokens of the prompt; the text model
takes them in order in place of its audio placeholder tokens.

Parameter paths (below the tower's root): subsample/{conv0,norm0,conv1,norm1,proj}, the layers
as the pattern stack lays them out (encoder layers: `stack/runs/0/0/...` scanned, `stack/layers/<i>/...`
unscanned; `layer_location`), output_proj/kernel, output_bias.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from MaxText.layers import stack
from MaxText.layers.linear import DenseGeneral, LayerKw, param
from MaxText.models.gemma4.audio_layers import (ACT_BTD, ConformerLayer, chunk_mask,
                                                relative_positions)
from MaxText.models.model_config import ModelConfig
from MaxText.sharding.rules import constrain

LAYER_KIND = "conformer"


def has_audio(cfg: ModelConfig) -> bool:
  return cfg.audio_hidden_size > 0


def layer_kinds(cfg: ModelConfig) -> tuple[str, ...]:
  return (LAYER_KIND,) * cfg.audio_num_layers


def layer_location(cfg: ModelConfig, i: int) -> tuple[tuple, int | None]:
  """Where HF audio layer i lives below the tower's root: (path, index on the stacked axis)."""
  path, index = stack.location(layer_kinds(cfg), cfg.scan_layers, i)
  return ("stack", *path), index


def problems(cfg: ModelConfig) -> list[tuple[str, str]]:
  """The audio keys' cross-checks: [(key, problem)] (none without an audio tower)."""
  if not has_audio(cfg):
    return []
  out = []
  D, H = cfg.audio_hidden_size, cfg.audio_num_heads
  if D % H:
    out.append(("audio_num_heads", f"audio_hidden_size={D} is not a multiple of {H} heads"))
  if D % 2:
    out.append(("audio_hidden_size", f"{D} must be even (sin/cos relative positions)"))
  channels = tuple(cfg.audio_subsampling_channels)
  if len(channels) != 2 or min(channels, default=0) < 1:
    out.append(("audio_subsampling_channels", f"{list(channels)}: two positive channel counts"))
  elif channels[0] < 4:
    out.append(("audio_subsampling_channels", f"{list(channels)}: the first must be >= 4 (it "
                "fixes the mel bins left after subsampling: channels[0] / 4)"))
  return out


def subsampled_bins(mel_bins: int) -> int:
  """Mel bins left after the two stride-2 convolutions (padding 1, kernel 3)."""
  once = (mel_bins + 1) // 2
  return (once + 1) // 2


class Subsample(nnx.Module):
  """HF `Gemma4AudioSubSampleConvProjection` (module doc)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    c0, c1 = cfg.audio_subsampling_channels
    pdt = cfg.param_dtype
    self.conv0 = param(rngs, (c0, 1, 3, 3), ("audio_conv", None, None, None), std=9 ** -0.5,
                       dtype=pdt)
    self.norm0 = param(rngs, (c0,), ("norm",), std=None, dtype=pdt)
    self.conv1 = param(rngs, (c1, c0, 3, 3), (None, "audio_conv", None, None),
                       std=(9 * c0) ** -0.5, dtype=pdt)
    self.norm1 = param(rngs, (c1,), ("norm",), std=None, dtype=pdt)
    self.bins = c0 // 4
    self.proj = DenseGeneral((self.bins * c1,), (cfg.audio_hidden_size,), (None, "audio_embed"),
                             rngs=rngs, dtype=cfg.compute_dtype, param_dtype=pdt)
    self.eps, self.dtype = cfg.audio_norm_epsilon, cfg.compute_dtype

  def _block(self, x_BSMC, valid_BS, kernel, scale):
    x_BSMC = x_BSMC * valid_BS[:, :, None, None].astype(x_BSMC.dtype)
    y = jax.lax.conv_general_dilated(
        x_BSMC, kernel[...].astype(self.dtype), window_strides=(2, 2), padding=((1, 1), (1, 1)),
        dimension_numbers=("NHWC", "OIHW", "NHWC"), precision=jax.lax.Precision.HIGHEST)
    y32 = y.astype(jnp.float32)
    mean = jnp.mean(y32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(y32 - mean), axis=-1, keepdims=True)
    y32 = (y32 - mean) * jax.lax.rsqrt(var + self.eps) * scale[...].astype(jnp.float32)
    return jax.nn.relu(y32.astype(self.dtype)), valid_BS[:, ::2]

  def __call__(self, features_BSM, valid_BS):
    B, _, M = features_BSM.shape
    if subsampled_bins(M) != self.bins:
      raise ValueError(f"input_features have {M} mel bins; this audio tower takes "
                       f"{4 * self.bins} (audio_subsampling_channels[0] = "
                       f"{4 * self.bins} fixes {self.bins} bins after subsampling)")
    x = features_BSM.astype(self.dtype)[..., None]
    x, valid = self._block(x, valid_BS, self.conv0, self.norm0)
    x, valid = self._block(x, valid, self.conv1, self.norm1)
    x_BTD = self.proj(x.reshape(B, x.shape[1], -1))
    return constrain(x_BTD, ACT_BTD), valid


class AudioTower(nnx.Module):
  """The audio encoder (module doc), a tower of the multimodal interface
  (MaxText/models/gemma4/towers.py): `tower(input_features_NSM, input_features_mask_NS)` →
  (its output [N, T, audio_output_dim], valid_NT); the text model's `embed_audio` brings the
  valid rows to its width."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    if not has_audio(cfg):
      raise ValueError("audio_hidden_size=0: the model has no audio tower")
    kw = LayerKw(rngs=rngs, dtype=cfg.compute_dtype, param_dtype=cfg.param_dtype)
    self.cfg = cfg
    self.subsample = Subsample(cfg, rngs=rngs)
    self.stack = stack.PatternStack(lambda kind, r: ConformerLayer(cfg, rngs=r),
                                    layer_kinds(cfg), scan=cfg.scan_layers,
                                    remat_policy=cfg.remat_policy, rngs=rngs)
    self.output_proj = DenseGeneral((cfg.audio_hidden_size,), (cfg.audio_output_dim,),
                                    ("audio_embed", None), **kw)
    self.output_bias = nnx.Param(jnp.zeros((cfg.audio_output_dim,), cfg.param_dtype),
                                 logical_axes=(None,))

  def __call__(self, features_BSM: jax.Array, mask_BS: jax.Array | None = None):
    if mask_BS is None:
      mask_BS = jnp.ones(features_BSM.shape[:2], bool)
    x_BTD, valid_BT = self.subsample(features_BSM, mask_BS.astype(bool))
    positions_RD = jnp.asarray(relative_positions(self.cfg))
    x_BTD = self.stack(x_BTD, positions_RD, chunk_mask(self.cfg, valid_BT))
    y_BTO = self.output_proj(x_BTD) + self.output_bias[...].astype(x_BTD.dtype)
    return constrain(y_BTO, ACT_BTD), valid_BT
