"""Images and audio in chat messages, as the OpenAI API sends them, taken only as base64 data URLs:
nothing named in a request is ever read from disk or fetched from the network.

Content parts (OpenAI's, and vLLM's `audio_url`):
  {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}   (or the url string)
  {"type": "input_audio", "input_audio": {"data": "<base64 WAV>", "format": "wav"}}
  {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,..."}}
Each becomes the part the chat template and the processor read (MaxText/data/multimodal/):
{"type": "image", "image": uint8 [H, W, 3]} or {"type": "audio", "audio": float32 waveform}.
A path, a `file://` or `http(s)://` URL, a data URL that is not base64, a payload that is not an
image / a WAV file (16 kHz mono or channels averaged, as the model's feature extractor takes it)
are refused with 400 naming the field (`messages[i].content[j].image_url.url`).
"""
from __future__ import annotations

import base64
import binascii
import io
from typing import Any

import numpy as np

from MaxText.data.multimodal.audio import wav_samples
from MaxText.data.multimodal.errors import MediaError
from MaxText.data.multimodal.images import read_image
from MaxText.serve.errors import ApiError

KINDS = ("image_url", "input_audio", "audio_url")
AUDIO_FORMATS = ("wav",)


def data_url(url: Any, field: str, what: str) -> tuple[str, bytes]:
  """(media type, bytes) of a base64 data URL; 400 naming `field` for anything else."""
  if not isinstance(url, str):
    raise ApiError(400, f"{field} must be a string (a base64 data URL)", field)
  if not url.startswith("data:"):
    scheme = url.split(":", 1)[0] + "://" if "://" in url else "a local path"
    raise ApiError(400, f"{field}: {what} arrive as base64 data URLs (data:<type>;base64,...); "
                   f"{scheme} is never read or fetched", field)
  header, comma, payload = url[len("data:"):].partition(",")
  if not comma or not header.endswith(";base64"):
    raise ApiError(400, f"{field}: a data URL with base64 content (data:<type>;base64,...)",
                   field)
  return header[:-len(";base64")], decoded(payload, field)


def decoded(payload: str, field: str) -> bytes:
  try:
    return base64.b64decode(payload, validate=True)
  except (binascii.Error, ValueError):
    raise ApiError(400, f"{field}: not valid base64", field) from None


def image_of(data: bytes, field: str) -> np.ndarray:
  """The image in `data` as uint8 [H, W, 3] (its EXIF orientation applied, as from a file)."""
  import PIL.Image  # pylint: disable=import-outside-toplevel
  import PIL.ImageOps  # pylint: disable=import-outside-toplevel
  try:
    with PIL.Image.open(io.BytesIO(data)) as opened:
      opened.load()
      image = PIL.ImageOps.exif_transpose(opened).convert("RGB")
    return read_image(image, field)
  except (OSError, ValueError, PIL.Image.DecompressionBombError, MediaError) as e:
    raise ApiError(400, f"{field}: cannot be read as an image: {e}", field) from None


def clip_of(data: bytes, field: str, sampling_rate: int | None) -> np.ndarray:
  """The WAV file in `data` as a mono float32 waveform (at `sampling_rate`, when given)."""
  try:
    return wav_samples(io.BytesIO(data), sampling_rate, field)
  except MediaError as e:
    raise ApiError(400, str(e), field) from None


def media_part(part: dict[str, Any], field: str, sampling_rate: int | None) -> dict[str, Any]:
  """The template's / processor's part for an image or audio content part (module docstring)."""
  kind = part.get("type")
  body = part.get(kind) if kind is not None else None
  if kind == "input_audio":
    if not isinstance(body, dict):
      raise ApiError(400, f"{field}.input_audio must be an object with data and format",
                     f"{field}.input_audio")
    fmt = body.get("format")
    if fmt not in AUDIO_FORMATS:
      raise ApiError(400, f"{field}.input_audio.format={fmt!r}: one of {list(AUDIO_FORMATS)}",
                     f"{field}.input_audio.format")
    if not isinstance(body.get("data"), str):
      raise ApiError(400, f"{field}.input_audio.data must be a base64 string",
                     f"{field}.input_audio.data")
    where = f"{field}.input_audio.data"
    return {"type": "audio", "audio": clip_of(decoded(body["data"], where), where, sampling_rate)}
  url = body.get("url") if isinstance(body, dict) else body
  where = f"{field}.{kind}.url" if isinstance(body, dict) else f"{field}.{kind}"
  mime, data = data_url(url, where, "images" if kind == "image_url" else "audio clips")
  if kind == "image_url":
    if not mime.startswith("image/"):
      raise ApiError(400, f"{where}: data:{mime}: an image_url takes image/* data", where)
    return {"type": "image", "image": image_of(data, where)}
  if mime not in ("audio/wav", "audio/x-wav", "audio/wave", "audio/vnd.wave"):
    raise ApiError(400, f"{where}: data:{mime}: audio as audio/wav", where)
  return {"type": "audio", "audio": clip_of(data, where, sampling_rate)}
