"""Images as Gemma 4's image processor prepares them (transformers' `Gemma4ImageProcessorPil`, the
PIL/NumPy one; its torchvision twin gives the same tensors): NumPy and Pillow, no torch.

One image → (patches [P, 3·p·p] float32, position ids [P, 2] int64, soft tokens):
  1. RGB: a file is opened, turned upright by its EXIF orientation and converted to RGB
     (`transformers.image_utils.load_image`); a PIL image or a uint8 [H, W, C] array (C = 1, 3, 4)
     goes through `convert_to_rgb` (grey repeated, transparency composited onto white).
  2. Resized (Pillow, `resample`: bicubic) to the largest size keeping the aspect ratio whose
     sides are multiples of k·p (k = pooling_kernel_size, p = patch_size) with at most
     max_soft_tokens·k² patches (`aspect_preserving_size`), unless it already has that size.
  3. × rescale_factor (1/255) in float64, then float32; (x − mean) / std when do_normalize.
  4. Cut into p × p patches in row-major order, each flattened (row, column, channel); a patch's
     position id is its (column, row) on the patch grid. Padded to the budget max_soft_tokens·k²
     with zero patches at position (−1, −1).
The image's soft tokens are its patches / k² (what the processor expands its placeholder to).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from MaxText.data.multimodal.errors import MediaError

SUPPORTED_SOFT_TOKENS = (70, 140, 280, 560, 1120)


@dataclass(frozen=True)
class ImageConfig:
  """The image processor's settings (its part of processor_config.json / preprocessor_config.json;
  transformers' defaults)."""
  patch_size: int = 16
  max_soft_tokens: int = 280
  pooling_kernel_size: int = 3
  do_resize: bool = True
  resample: int = 3                      # PIL.Image.Resampling.BICUBIC
  do_rescale: bool = True
  rescale_factor: float = 1 / 255
  do_normalize: bool = False
  image_mean: tuple[float, ...] = (0.0, 0.0, 0.0)
  image_std: tuple[float, ...] = (1.0, 1.0, 1.0)
  do_convert_rgb: bool = True

  @classmethod
  def from_dict(cls, values: dict[str, Any], where: str) -> "ImageConfig":
    """The settings `values` holds (others keep their defaults); ValueError naming `where` when
    max_soft_tokens is not one the processor supports."""
    known = {k: values[k] for k in cls.__dataclass_fields__ if values.get(k) is not None}
    for k in ("image_mean", "image_std"):
      if k in known:
        v = known[k]
        known[k] = tuple(float(x) for x in (v if isinstance(v, (list, tuple)) else [v] * 3))
    cfg = cls(**known)
    if cfg.max_soft_tokens not in SUPPORTED_SOFT_TOKENS:
      raise ValueError(f"{where}: max_soft_tokens={cfg.max_soft_tokens} must be one of "
                       f"{SUPPORTED_SOFT_TOKENS}")
    return cfg

  @property
  def max_patches(self) -> int:
    return self.max_soft_tokens * self.pooling_kernel_size ** 2


def aspect_preserving_size(height: int, width: int, patch_size: int, max_patches: int,
                           pooling_kernel_size: int) -> tuple[int, int]:
  """The largest (height, width) with the image's aspect ratio, sides multiples of
  pooling_kernel_size · patch_size and at most `max_patches` patches (transformers'
  `get_aspect_ratio_preserving_size`, the same arithmetic); ValueError when none exists."""
  target_px = max_patches * patch_size ** 2
  factor = math.sqrt(target_px / (height * width))
  side = pooling_kernel_size * patch_size
  h = int(math.floor(factor * height / side)) * side
  w = int(math.floor(factor * width / side)) * side
  if h == 0 and w == 0:
    raise ValueError(f"a {height}x{width} image resizes to 0x0")
  longest = (max_patches // pooling_kernel_size ** 2) * side
  if h == 0:
    h, w = side, min(int(math.floor(width / height)) * side, longest)
  elif w == 0:
    h, w = min(int(math.floor(height / width)) * side, longest), side
  if h * w > target_px:
    raise ValueError(f"a {height}x{width} image resizes to {h}x{w}, over the budget of "
                     f"{max_patches} patches of {patch_size} px")
  return h, w


def _pil():
  import PIL.Image  # pylint: disable=import-outside-toplevel
  import PIL.ImageOps  # pylint: disable=import-outside-toplevel
  return PIL


def _pil_to_rgb(image) -> np.ndarray:
  """transformers' `convert_to_rgb` of a PIL image: transparency composited onto white."""
  PIL = _pil()
  if "A" in image.getbands() or image.info.get("transparency") is not None:
    image = image.convert("RGBA")
    white = PIL.Image.new("RGBA", image.size, (255, 255, 255, 255))
    return np.array(PIL.Image.alpha_composite(white, image).convert("RGB"))
  return np.array(image.convert("RGB"))


def _array_to_rgb(image: np.ndarray, what: str) -> np.ndarray:
  """transformers' `convert_to_rgb` of a uint8 [H, W, C] array."""
  if image.dtype != np.uint8 or image.ndim != 3 or image.shape[-1] not in (1, 3, 4):
    raise MediaError(f"{what}: an image array must be uint8 [height, width, channels] with 1, 3 "
                     f"or 4 channels, got {image.dtype} {list(image.shape)}")
  if image.shape[-1] == 1:
    return np.repeat(image, 3, axis=-1)
  if image.shape[-1] == 4:
    alpha = image[..., 3:4] / 255
    return np.round(alpha * image[..., :3] + (1 - alpha) * 255).astype(np.uint8)
  return image


def read_image(source: Any, what: str = "image", convert_rgb: bool = True) -> np.ndarray:
  """An image as uint8 [H, W, C] (module docstring, step 1): a path, a PIL image or a uint8
  array. MediaError (exit 3) naming the file when it is missing or not an image."""
  PIL = _pil()
  if isinstance(source, (str, os.PathLike)):
    path = os.path.expanduser(os.fspath(source))
    try:
      with PIL.Image.open(path) as opened:
        opened.load()
        image = PIL.ImageOps.exif_transpose(opened).convert("RGB")
    except FileNotFoundError:
      raise MediaError(f"{what} {path} does not exist") from None
    except (OSError, ValueError, PIL.Image.DecompressionBombError) as e:
      raise MediaError(f"{what} {path} cannot be read as an image: {e}") from None
    return _pil_to_rgb(image) if convert_rgb else np.array(image)
  if isinstance(source, PIL.Image.Image):
    return _pil_to_rgb(source) if convert_rgb else np.array(source)
  if isinstance(source, np.ndarray):
    return _array_to_rgb(source, what) if convert_rgb else source
  raise MediaError(f"{what}: expected a file path, a PIL image or a uint8 array, got "
                   f"{type(source).__name__}")


@dataclass
class ProcessedImage:
  patches: np.ndarray        # [max_patches, 3·p·p] float32 (zero rows past the image)
  positions: np.ndarray      # [max_patches, 2] int64: (column, row); (−1, −1) past the image
  grid: tuple[int, int]      # (rows, columns) of patches
  soft_tokens: int           # patches / k²


def preprocess(image_HWC: np.ndarray, cfg: ImageConfig, what: str = "image") -> ProcessedImage:
  """Steps 2–4 of the module docstring on an RGB uint8 [H, W, C] image."""
  p, k = cfg.patch_size, cfg.pooling_kernel_size
  H, W = image_HWC.shape[:2]
  if cfg.do_resize:
    try:
      h, w = aspect_preserving_size(H, W, p, cfg.max_patches, k)
    except ValueError as e:
      raise MediaError(f"{what}: {e}") from None
    if (h, w) != (H, W):
      PIL = _pil()
      squeezed = image_HWC[..., 0] if image_HWC.shape[-1] == 1 else image_HWC
      resized = np.array(PIL.Image.fromarray(squeezed).resize((w, h), resample=cfg.resample))
      image_HWC = resized[..., None] if resized.ndim == 2 else resized
  image_CHW = np.moveaxis(image_HWC, -1, 0)
  if cfg.do_rescale:
    image_CHW = (image_CHW.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
  if cfg.do_normalize:
    x = image_CHW if np.issubdtype(image_CHW.dtype, np.floating) else image_CHW.astype(np.float32)
    mean, std = np.array(cfg.image_mean, x.dtype), np.array(cfg.image_std, x.dtype)
    image_CHW = ((x.T - mean) / std).T
  C, H, W = image_CHW.shape
  rows, cols = H // p, W // p
  if rows * cols > cfg.max_patches:
    raise MediaError(f"{what}: {H}x{W} px is {rows * cols} patches, over the budget of "
                     f"{cfg.max_patches} (set do_resize)")
  patches = image_CHW.reshape(C, rows, p, cols, p).transpose(1, 3, 2, 4, 0).reshape(rows * cols, -1)
  grid_x, grid_y = np.meshgrid(np.arange(cols), np.arange(rows), indexing="xy")
  positions = np.stack([grid_x, grid_y], axis=-1).reshape(rows * cols, 2)
  pad = cfg.max_patches - rows * cols
  patches = np.pad(patches.astype(np.float32), [(0, pad), (0, 0)])
  positions = np.pad(positions.astype(np.int64), [(0, pad), (0, 0)], constant_values=-1)
  return ProcessedImage(patches, positions, (rows, cols), rows * cols // k ** 2)
