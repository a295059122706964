"""SFT rows with images and audio: a conversation's media as fixed-size slots beside its tokens.

A chat record's user (or system) messages may hold image and audio content parts
(`{"type": "image", "image": PATH}`, `{"type": "audio", "audio": PATH}`; a relative path is taken
from the record's jsonl folder). The chat template renders one placeholder token per part; the
model's processor (MaxText/data/multimodal/processor.py, equal to transformers' Gemma4Processor)
reads and preprocesses each image / clip and expands each placeholder to begin, soft tokens, end —
inside the data pipeline's map (Grain's worker processes with `grain_worker_count`), never on the
training step's thread. The expanded tokens take the loss-mask value of their placeholder (0 in a
user turn).

Each row then holds, besides the batch contract's token arrays (data/batch.py), its media in slots
of fixed shapes (`MediaSlots`), so every batch has one shape:
  pixel_values         [N, P, C] float32   N = max_num_images_per_example, P the processor's
                                           patch budget, C = 3 · patch²
  image_position_ids   [N, P, 2] int32     −1 past an image's patches and in an empty slot
  input_features       [A, T, F] float32   A = max_num_audio_per_example, T the frames of
                                           max_audio_seconds, F mel bins
  input_features_mask  [A, T] bool         False past a clip's frames and in an empty slot
An empty slot yields no soft token (towers.py: items with no valid row are allowed), so the
model's merge — which hands out the valid rows of all items in row-major order — puts each
conversation's soft tokens at its own placeholders. The train step flattens the slots of a batch
to the towers' [B·N, ...] (losses/token_loss.py).

A conversation with more images or clips than its slots, a longer clip, or one whose expanded
tokens do not fit max_target_length (cutting soft tokens would misplace the rest) is a bad record
naming the limit; packing (`packing=true`) does not take media rows.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from MaxText.data.errors import DataError
from MaxText.data.multimodal import audio as audio_lib
from MaxText.data.multimodal.processor import Processor, media_of_messages



@dataclass(frozen=True)
class MediaSlots:
  """Each row's media slots (module docstring); 0 images / 0 clips: none of that kind."""
  images: int
  patches: int
  channels: int
  clips: int
  frames: int
  mel_bins: int

  def specs(self) -> dict[str, tuple[tuple[int, ...], Any]]:
    """{key: (per-row shape, dtype)} of the media keys a row holds."""
    out: dict[str, tuple[tuple[int, ...], Any]] = {}
    if self.images:
      out["pixel_values"] = ((self.images, self.patches, self.channels), np.float32)
      out["image_position_ids"] = ((self.images, self.patches, 2), np.int32)
    if self.clips:
      out["input_features"] = ((self.clips, self.frames, self.mel_bins), np.float32)
      out["input_features_mask"] = ((self.clips, self.frames), np.bool_)
    return out

  def empty(self) -> dict[str, np.ndarray]:
    out = {}
    for k, (shape, dtype) in self.specs().items():
      out[k] = np.full(shape, -1 if k == "image_position_ids" else 0, dtype)
    return out


def slots_for(processor: Processor | None, images: int, clips: int,
              max_audio_seconds: float) -> MediaSlots | None:
  """The slots of `max_num_images_per_example` / `max_num_audio_per_example` for this processor;
  None when both are 0. DataError naming the key when the processor cannot take that modality."""
  if not images and not clips:
    return None
  for n, modality, key in ((images, "image", "max_num_images_per_example"),
                           (clips, "audio", "max_num_audio_per_example")):
    if not n:
      continue
    problem = "no processor files beside the tokenizer" if processor is None \
        else processor.takes(modality)
    if problem:
      raise DataError(f"{key}={n}: {problem}")
  assert processor is not None
  patches = channels = frames = bins = 0
  if images:
    cfg = processor.image
    assert cfg is not None   # (processor.takes("image") above)
    patches = cfg.max_soft_tokens * cfg.pooling_kernel_size ** 2
    channels = 3 * cfg.patch_size ** 2
  if clips:
    cfg = processor.audio
    assert cfg is not None   # (processor.takes("audio") above)
    rate = cfg.sampling_rate
    feats, _ = audio_lib.features([np.zeros(int(round(max_audio_seconds * rate)), np.float32)],
                                  cfg)
    frames, bins = feats.shape[1], feats.shape[2]
  return MediaSlots(images, patches, channels, clips, frames, bins)


def _resolve(source: Any, folder: str) -> Any:
  """A relative path is the record file's folder's (when it exists there)."""
  if isinstance(source, str) and not os.path.isabs(source):
    there = os.path.join(folder, source)
    if os.path.exists(there):
      return there
  return source


def expand(processor: Processor, slots: MediaSlots, messages: list[dict], ids: np.ndarray,
           mask: np.ndarray, where: str) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
  """(expanded ids, their assistant mask, the row's media slots) of a tokenized conversation.
  DataError (a bad record) for more media than slots or a clip longer than its slot; MediaError
  (exit 3) for a file that cannot be read."""
  images, clips = media_of_messages(messages)
  folder = os.path.dirname(where.rsplit(" line ", 1)[0])
  images = [_resolve(s, folder) for s in images]
  clips = [_resolve(s, folder) for s in clips]
  out = slots.empty()
  if not images and not clips:
    return ids, mask, out
  for n, cap, key in ((len(images), slots.images, "max_num_images_per_example"),
                      (len(clips), slots.clips, "max_num_audio_per_example")):
    if n > cap:
      raise DataError(f"the conversation holds {n} {key.split('_')[3]} input(s), more than "
                      f"{key}={cap}")
  batch = processor.prepare([ids.tolist()], [images], [clips])
  image_id, audio_id = processor.ids.get("image_token"), processor.ids.get("audio_token")
  counts = {image_id: iter(batch.image_soft_tokens), audio_id: iter(batch.audio_soft_tokens)}
  widths = [next(counts[t]) + 2 if t in counts and t is not None else 1 for t in ids.tolist()]
  new_mask = np.repeat(mask, widths).astype(np.int32)
  new_ids = np.asarray(batch.input_ids[0], np.int32)
  assert new_ids.shape == new_mask.shape
  if images:
    out["pixel_values"][:len(images)] = batch.pixel_values
    out["image_position_ids"][:len(images)] = batch.image_position_ids
  if clips:
    feats, valid = batch.input_features, batch.input_features_mask
    assert feats is not None and valid is not None   # (prepare fills them for clips)
    if feats.shape[1] > slots.frames:
      raise DataError(f"a clip of {feats.shape[1]} feature frames is longer than "
                      f"max_audio_seconds ({slots.frames} frames)")
    out["input_features"][:len(clips), :feats.shape[1]] = feats
    out["input_features_mask"][:len(clips), :feats.shape[1]] = valid
  return new_ids, new_mask, out
