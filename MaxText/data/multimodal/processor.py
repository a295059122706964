"""A multimodal model's processor (transformers' `Gemma4Processor`), read from the model's folder:
prompts with image / audio placeholders → the model's token ids and tensors.

Files (next to the tokenizer's; a converted checkpoint carries them in its `tokenizer/` item):
  processor_config.json     the processor; its "image_processor" and "feature_extractor" objects
                            (transformers 5 writes them there)
  preprocessor_config.json  the older layout: the image processor's and the feature extractor's
                            settings in one object (used for a part processor_config.json lacks)
  tokenizer_config.json     the placeholder tokens: image_token, boi_token, eoi_token,
                            audio_token, boa_token, eoa_token (top-level, or in
                            extra_special_tokens / model_specific_special_tokens)

A prompt holds one placeholder id per image (the image token) and per clip (the audio token), in
the order of its images and clips. `Processor.prepare` turns a call's prompts into a `Batch`, as
the processor turns texts, images and audio into its BatchFeature: each image placeholder becomes
boi, the image's soft tokens × image token, eoi; each audio placeholder boa, the clip's soft tokens
× audio token, eoa; `mm_token_type_ids` marks image tokens 1, video tokens 2, audio tokens 3 (0
elsewhere, boi/eoi/boa/eoa included); images are stacked in prompt order (`pixel_values`,
`image_position_ids`), clips likewise, padded to the call's longest (`input_features`,
`input_features_mask`). Expanding ids rather than text is the same as the processor's text
expansion: the placeholder tokens are added tokens, which the tokenizer splits the text at.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from MaxText.data import tokenizers
from MaxText.data.errors import DataError
from MaxText.data.multimodal import audio as audio_lib
from MaxText.data.multimodal import images as images_lib
from MaxText.data.multimodal.errors import MediaError

FILES = ("processor_config.json", "preprocessor_config.json")
TOKEN_NAMES = ("image_token", "boi_token", "eoi_token", "audio_token", "boa_token", "eoa_token")
VIDEO_TOKEN = "<|video|>"          # the processor adds it to every Gemma 4 tokenizer
MODALITIES = ("image", "audio")
TYPE_IDS = {"image": 1, "video": 2, "audio": 3}     # transformers' mm_token_type_ids


def has_processor(folder: str) -> bool:
  return any(os.path.isfile(os.path.join(folder, n)) for n in FILES)


def _token_strings(folder: str) -> dict[str, str]:
  """{image_token: "<|image|>", ...} as transformers' tokenizer reads them from
  tokenizer_config.json (module docstring)."""
  path = os.path.join(folder, "tokenizer_config.json")
  config = tokenizers.json_object(path) if os.path.isfile(path) else {}
  found = {}
  for source in (config, config.get("model_specific_special_tokens"),
                 config.get("extra_special_tokens")):
    if not isinstance(source, dict):
      continue
    for name in TOKEN_NAMES:
      value = source.get(name)
      value = value.get("content") if isinstance(value, dict) else value
      if isinstance(value, str):
        found[name] = value
  return found


@dataclass
class Batch:
  """A call's prompts as the model takes them (transformers' names)."""
  input_ids: list[list[int]]
  mm_token_type_ids: list[list[int]]
  pixel_values: np.ndarray | None = None          # [I, P, 3·p·p] float32
  image_position_ids: np.ndarray | None = None    # [I, P, 2] int64, −1 past each image
  input_features: np.ndarray | None = None        # [A, T, F] float32
  input_features_mask: np.ndarray | None = None   # [A, T] bool
  image_rows: list[int] = field(default_factory=list)   # the prompt of each image
  audio_rows: list[int] = field(default_factory=list)   # the prompt of each clip
  image_grids: list[tuple[int, int]] = field(default_factory=list)  # (rows, columns) of patches
  image_soft_tokens: list[int] = field(default_factory=list)
  audio_soft_tokens: list[int] = field(default_factory=list)

  def tensors(self, row: int | None = None) -> dict[str, np.ndarray]:
    """The model's tensors by transformers' names (those there are), of every prompt or of the
    prompt `row`."""
    out = {}
    for names, rows in ((("pixel_values", "image_position_ids"), self.image_rows),
                        (("input_features", "input_features_mask"), self.audio_rows)):
      pick = [i for i, r in enumerate(rows) if row is None or r == row]
      for name in names:
        value = getattr(self, name)
        if value is not None and pick:
          out[name] = value[pick]
    return out

  def soft_tokens(self, row: int) -> tuple[int, int]:
    """(image soft tokens, audio soft tokens) of prompt `row`."""
    return (sum(n for n, r in zip(self.image_soft_tokens, self.image_rows) if r == row),
            sum(n for n, r in zip(self.audio_soft_tokens, self.audio_rows) if r == row))


class Processor:
  """The processor of the model whose tokenizer is `tokenizer` (module docstring)."""

  def __init__(self, folder: str, vocab: dict[str, int]):
    self.folder = folder
    config: dict = {}
    legacy: dict = {}
    for name in FILES:
      path = os.path.join(folder, name)
      if os.path.isfile(path):
        (config if name == FILES[0] else legacy).update(tokenizers.json_object(path))
    image, extractor = config.get("image_processor"), config.get("feature_extractor")
    if not isinstance(image, dict) and ({"image_processor_type", "patch_size"} & set(legacy)):
      image = legacy
    if not isinstance(extractor, dict) and ({"feature_extractor_type", "feature_size"}
                                            & set(legacy)):
      extractor = legacy
    try:
      self.image = images_lib.ImageConfig.from_dict(image, folder) \
          if isinstance(image, dict) else None
      self.audio = audio_lib.AudioConfig.from_dict(extractor, folder) \
          if isinstance(extractor, dict) else None
    except (TypeError, ValueError) as e:
      raise DataError(f"the processor in {folder}: {e}") from None
    self.tokens = _token_strings(folder)
    self.ids: dict[str, int] = {}
    for name, token in self.tokens.items():
      if token not in vocab:
        raise DataError(f"{os.path.join(folder, 'tokenizer_config.json')} names "
                        f"{name}={token!r}, which is not in the tokenizer's vocabulary")
      self.ids[name] = int(vocab[token])
    self.video_id = vocab.get(VIDEO_TOKEN)

  @classmethod
  def for_tokenizer(cls, tokenizer: Any) -> "Processor | None":
    """The processor beside a Hugging Face tokenizer's tokenizer.json, or None without one."""
    path = getattr(tokenizer, "path", None)
    if not isinstance(tokenizer, tokenizers.HFTokenizer) or not path:
      return None
    folder = os.path.dirname(path)
    if not has_processor(folder):
      return None
    return cls(folder, tokenizer.impl.get_vocab(with_added_tokens=True))

  # ---- what it takes --------------------------------------------------------------------------
  def takes(self, modality: str) -> str | None:
    """None when the processor prepares `modality` ("image" / "audio"), else why not."""
    settings = self.image if modality == "image" else self.audio
    names = (f"{modality}_token", "boi_token", "eoi_token") if modality == "image" else \
        ("audio_token", "boa_token", "eoa_token")
    if settings is None:
      part = "image_processor" if modality == "image" else "feature_extractor"
      return f"the processor in {self.folder} has no {part} settings"
    missing = [n for n in names if n not in self.ids]
    if missing:
      return (f"{os.path.join(self.folder, 'tokenizer_config.json')} names no "
              f"{', '.join(missing)}")
    return None

  def placeholder(self, modality: str) -> int:
    """The id a prompt holds for each image / clip (the image or audio token)."""
    problem = self.takes(modality)
    if problem:
      raise DataError(f"{modality} inputs: {problem}")
    return self.ids[f"{modality}_token"]

  def token(self, name: str) -> str | None:
    """A placeholder token's text (image_token, boi_token, ...), None when not named."""
    return self.tokens.get(name)

  # ---- a call ---------------------------------------------------------------------------------
  def prepare(self, prompts: Sequence[Sequence[int]], images: Sequence[Sequence[Any]],
              clips: Sequence[Sequence[Any]]) -> Batch:
    """A call's prompts (ids with one placeholder per image and per clip) with their images
    (paths, PIL images, uint8 arrays) and clips (WAV paths, 1-D float arrays at the extractor's
    rate), per prompt. DataError when a prompt's placeholders do not match its media; MediaError
    when an image or clip cannot be read."""
    flat_images, image_rows, flat_clips, audio_rows = [], [], [], []
    for row, (ids, imgs, auds) in enumerate(zip(prompts, images, clips)):
      for modality, media in (("image", imgs), ("audio", auds)):
        want = ids.count(self.placeholder(modality)) if media or self.ids.get(
            f"{modality}_token") in ids else 0
        if want != len(media):
          raise DataError(f"prompt {row} holds {want} {modality} placeholder(s) "
                          f"({self.tokens.get(f'{modality}_token')}) for {len(media)} "
                          f"{modality} input(s)")
      flat_images += [(row, i, m) for i, m in enumerate(imgs)]
      flat_clips += [(row, i, m) for i, m in enumerate(auds)]
      image_rows += [row] * len(imgs)
      audio_rows += [row] * len(auds)
    batch = Batch(input_ids=[], mm_token_type_ids=[], image_rows=image_rows, audio_rows=audio_rows)
    if flat_images:
      assert self.image is not None
      done = [images_lib.preprocess(
                  images_lib.read_image(m, f"image {i} of prompt {r}", self.image.do_convert_rgb),
                  self.image, f"image {i} of prompt {r}") for r, i, m in flat_images]
      batch.pixel_values = np.stack([d.patches for d in done])
      batch.image_position_ids = np.stack([d.positions for d in done])
      batch.image_grids = [d.grid for d in done]
      batch.image_soft_tokens = [d.soft_tokens for d in done]
    if flat_clips:
      assert self.audio is not None
      waves = [audio_lib.as_clip(m, self.audio, f"audio {i} of prompt {r}")
               for r, i, m in flat_clips]
      batch.input_features, batch.input_features_mask = audio_lib.features(waves, self.audio)
      batch.audio_soft_tokens = [audio_lib.soft_tokens(m) for m in batch.input_features_mask]
    image_counts, audio_counts = iter(batch.image_soft_tokens), iter(batch.audio_soft_tokens)
    for ids in prompts:
      expanded = self.expand(ids, image_counts, audio_counts)
      batch.input_ids.append(expanded)
      batch.mm_token_type_ids.append(self.token_types(expanded))
    return batch

  def expand(self, ids: Sequence[int], image_counts, audio_counts) -> list[int]:
    """`ids` with each placeholder replaced by its begin token, its soft tokens (the next count
    of `image_counts` / `audio_counts`) and its end token."""
    image, audio = self.ids.get("image_token"), self.ids.get("audio_token")
    out: list[int] = []
    for t in ids:
      if image is not None and t == image:
        out += [self.ids["boi_token"], *[image] * next(image_counts), self.ids["eoi_token"]]
      elif audio is not None and t == audio:
        out += [self.ids["boa_token"], *[audio] * next(audio_counts), self.ids["eoa_token"]]
      else:
        out.append(int(t))
    return out

  def token_types(self, ids: Sequence[int]) -> list[int]:
    """transformers' `mm_token_type_ids` of expanded ids."""
    kinds = {self.ids.get("image_token"): TYPE_IDS["image"], self.video_id: TYPE_IDS["video"],
             self.ids.get("audio_token"): TYPE_IDS["audio"]}
    kinds.pop(None, None)
    return [kinds.get(int(t), 0) for t in ids]

  # ---- tensors given as they are --------------------------------------------------------------
  def soft_tokens_of(self, tensors: dict[str, np.ndarray]) -> tuple[list[int], list[int]]:
    """(soft tokens per image, per clip) of the processor's own tensors (image_position_ids:
    the real patches / k²; input_features_mask: through the subsampling)."""
    k2 = (self.image.pooling_kernel_size if self.image else 3) ** 2
    positions = tensors.get("image_position_ids")
    mask = tensors.get("input_features_mask")
    per_image = [] if positions is None else \
        [int((np.asarray(p)[..., 0] >= 0).sum()) // k2 for p in positions]
    per_clip = [] if mask is None else [audio_lib.soft_tokens(np.asarray(m, bool)) for m in mask]
    return per_image, per_clip

  @staticmethod
  def grid_of(positions: np.ndarray) -> tuple[int, int]:
    """(rows, columns) of an image's patch grid from its position ids."""
    real = np.asarray(positions)[np.asarray(positions)[:, 0] >= 0]
    return (int(real[:, 1].max()) + 1, int(real[:, 0].max()) + 1) if len(real) else (0, 0)


def media_of_messages(messages: Sequence[dict]) -> tuple[list[Any], list[Any]]:
  """(images, clips) of chat messages' content parts, in order, as transformers' processor takes
  them from a conversation: an image part's "image" / "url" / "path", an audio part's "audio" /
  "url" / "path" (a part without one has no source: None, filled by the caller)."""
  images, clips = [], []
  for message in messages if isinstance(messages, (list, tuple)) else []:
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, (list, tuple)):
      continue
    for part in content:
      if not isinstance(part, dict):
        continue
      kind = part.get("type")
      keys = ("image", "url", "path", "base64") if kind == "image" else \
          ("audio", "url", "path") if kind == "audio" else ()
      found = [part[k] for k in keys if k in part]
      if kind in MODALITIES:
        for source in found or [None]:
          if isinstance(source, str) and source.startswith(("http://", "https://")):
            raise MediaError(f"{kind} {source}: nothing is downloaded; give a local file")
          (images if kind == "image" else clips).append(source)
  return images, clips
