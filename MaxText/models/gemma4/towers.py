"""Gemma 4's encoder towers as the text model sees them: the table of towers, the multimodal
embedder that brings a tower's soft tokens to the text width, and the merge that puts them where
their placeholder ids are (Hugging Face `Gemma4Model.forward`, `Gemma4MultimodalEmbedder`).

Conventions: B batch, S sequence, D text width, N items of one modality (images, clips), M soft
tokens per item (the tower's padded count), d a tower's output width.

The tower interface. A tower is an NNX module built as `build(mcfg, rngs=rngs)` and called with
its inputs — the processor's tensors, by transformers' names, in the order `Tower.inputs` lists
them — returning `(soft_NMd, valid_NM)`: every item's soft tokens in order (row-major for an
image's pooled grid, time order for a clip) and which of the M rows are real. A `Tower` row below
declares it: its parameter subtree (`name`; its embedder is `embed_<name>`), the inputs it reads,
its placeholder token id, whether the config has it, its output width and its norm epsilon. The
text model (model.py) holds every tower the config has: the vision encoder (vision.py) and the
audio conformer (audio.py) are one row each of `TOWERS`; a new tower is one more row.

The embedding step (`Transformer._inputs`), as transformers computes it:
  ids = tokens with every placeholder id (image, video, audio) replaced by `mm_pad_token_id`
  x = embedding[ids] · sqrt(D);  the per-layer inputs (PLE) look up `ids` too
  for each tower whose inputs are in `media`: soft = embed_<name>(tower(*inputs))
      (embedder: scale-free RMSNorm over d, then a d → D projection, no bias)
      the valid rows of all items, in item order, replace x where tokens == its placeholder id, in
      row-major (b, s) order — the processor puts item n's soft-token run after item n-1's
  the PLE projection then reads the merged x.
The soft tokens are computed once per prompt: in training's forward and in decoding's prefill
(`extend(prefill=True, media=...)`); decoding steps read only the cache, which is unchanged.

`media` is a dict of arrays (NumPy or jax) by those names, e.g. {"pixel_values": [N, P, C],
"image_position_ids": [N, P, 2]}; images of a batch are in the order their placeholder runs
appear (row 0's first). Items that are all padding (no valid row) are allowed (a fixed-size batch
of images); more placeholders than valid rows is the caller's error (they would read row 0).

Bidirectional attention (`mm_bidirectional_vision`, transformers' use_bidirectional_attention =
"vision"): on sliding layers the tokens of one image (a run of image or video placeholder ids)
also attend to each other both ways (still inside the window's lower bound); full layers stay
causal; audio stays causal. `vision_blocks` gives the run ids (transformers'
`get_block_sequence_ids_for_mask`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from MaxText.layers import sites
from MaxText.layers.linear import DenseGeneral
from MaxText.layers.norms import rms_normalize
from MaxText.models.gemma4 import audio, vision
from MaxText.models.model_config import ModelConfig


@dataclass(frozen=True)
class Tower:
  name: str                                       # parameter subtree; its embedder: embed_<name>
  inputs: tuple[str, ...]                         # the media keys it reads, in call order
  token_id: Callable[[ModelConfig], int]          # its placeholder id
  present: Callable[[ModelConfig], bool]          # whether the config has this tower
  build: Callable[..., nnx.Module]                # build(mcfg, rngs=rngs)
  width: Callable[[ModelConfig], int]             # d: its soft tokens' width
  eps: Callable[[ModelConfig], float]             # the embedder's norm epsilon
  axis: str | None                                # the logical axis of its width
  frozen: Callable[[ModelConfig], bool]           # training leaves it (and its embedder) as is
  modality: str                                   # what it reads: "image" | "audio"


TOWERS: tuple[Tower, ...] = (
    Tower("vision", ("pixel_values", "image_position_ids"), lambda c: c.image_token_id,
          vision.has_vision, vision.VisionTower, lambda c: c.vision_emb_dim,
          lambda c: c.vision_norm_epsilon, "vision_embed", lambda c: c.freeze_vision_encoder,
          "image"),
    Tower("audio", ("input_features", "input_features_mask"), lambda c: c.audio_token_id,
          audio.has_audio, audio.AudioTower, lambda c: c.audio_output_dim,
          lambda c: c.audio_norm_epsilon, None, lambda c: c.freeze_audio_encoder, "audio"),
)
MEDIA_KEYS = frozenset(k for t in TOWERS for k in t.inputs)


def towers_of(cfg: ModelConfig) -> tuple[Tower, ...]:
  return tuple(t for t in TOWERS if t.present(cfg))


def modalities(cfg: ModelConfig) -> frozenset[str]:
  """What the model reads besides token ids ("image", "audio"): its towers' modalities."""
  return frozenset(t.modality for t in towers_of(cfg))


def placeholder_ids(cfg: ModelConfig) -> tuple[int, ...]:
  """The ids embedded as `mm_pad_token_id` (a multimodal model's image, video and audio
  placeholders, whether or not it has every tower, as transformers does); () for a text model."""
  if not towers_of(cfg):
    return ()
  return (cfg.image_token_id, cfg.video_token_id, cfg.audio_token_id)


class Embedder(nnx.Module):
  """Soft tokens [..., d] → the text width [..., D]: scale-free RMSNorm, then a projection."""

  def __init__(self, cfg: ModelConfig, tower: Tower, *, rngs: nnx.Rngs):
    self.proj = DenseGeneral((tower.width(cfg),), (cfg.emb_dim,), (tower.axis, "embed"),
                             rngs=rngs, dtype=cfg.compute_dtype, param_dtype=cfg.param_dtype)
    self.eps, self.dtype = tower.eps(cfg), cfg.compute_dtype

  def __call__(self, soft_NMd):
    return self.proj(rms_normalize(soft_NMd, self.eps).astype(self.dtype))


def scatter(x_BSD, slots_BS, soft_KD, valid_K):
  """x with the valid rows of `soft` (in order) at the `slots` (in row-major order)."""
  K = soft_KD.shape[0]
  dest_K = jnp.where(valid_K, jnp.cumsum(valid_K) - 1, K)
  packed_KD = jnp.zeros_like(soft_KD).at[dest_K].set(soft_KD, mode="drop")
  rank_BS = jnp.cumsum(slots_BS.reshape(-1)).reshape(slots_BS.shape) - 1
  got_BSD = jnp.take(packed_KD, jnp.clip(rank_BS, 0, K - 1), axis=0)
  return jnp.where(slots_BS[..., None], got_BSD.astype(x_BSD.dtype), x_BSD)


def vision_blocks(cfg: ModelConfig, tokens_BS):
  """Per token the index of its run of image (or video) placeholders within its row, -1 for
  other tokens: tokens of one run attend to each other both ways on sliding layers."""
  is_vision = (tokens_BS == cfg.image_token_id) | (tokens_BS == cfg.video_token_id)
  prev = jnp.pad(is_vision[:, :-1], ((0, 0), (1, 0)))
  runs = jnp.cumsum(is_vision & ~prev, axis=1) - 1
  return jnp.where(is_vision, runs, -1).astype(jnp.int32)


def check_media(cfg: ModelConfig, media: dict) -> None:
  """ValueError naming a media key no tower of this model reads."""
  readers = {k for t in towers_of(cfg) for k in t.inputs}
  unknown = sorted(set(media) - readers)
  if unknown:
    have = ", ".join(t.name for t in towers_of(cfg)) or "none"
    raise ValueError(f"media inputs {unknown}: this model's towers ({have}) do not read them")


def merge(cfg: ModelConfig, model: nnx.Module, x_BSD, tokens_BS, media: dict):
  """x with each tower's soft tokens at its placeholder ids (the towers of `model`, an
  attribute per `Tower.name` and its embedder `embed_<name>`)."""
  check_media(cfg, media)
  for tower in towers_of(cfg):
    if not all(k in media for k in tower.inputs):
      continue
    with sites.unprobed():   # the towers' layers are no decoder layers' sites
      soft_NMd, valid_NM = getattr(model, tower.name)(*(jnp.asarray(media[k])
                                                        for k in tower.inputs))
      soft_NMD = getattr(model, "embed_" + tower.name)(soft_NMd)
    if tower.frozen(cfg):   # frozen: no gradient flows into the tower (it runs forward only)
      soft_NMD = jax.lax.stop_gradient(soft_NMD)
    D = soft_NMD.shape[-1]
    x_BSD = scatter(x_BSD, tokens_BS == tower.token_id(cfg), soft_NMD.reshape(-1, D),
                    valid_NM.reshape(-1))
  return x_BSD


def has_images(media: dict | None) -> bool:
  return bool(media) and "pixel_values" in media

