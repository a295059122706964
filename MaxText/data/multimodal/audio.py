"""Audio as Gemma 4's feature extractor prepares it (transformers' `Gemma4AudioFeatureExtractor`):
log-mel frames and their mask, NumPy only.

A batch of clips (mono float waveforms at `sampling_rate`):
  1. each clip cut to `max_length` samples, then all right-padded with zeros to the longest,
     rounded up to a multiple of `pad_to_multiple_of` (a float64 clip becomes float32 after);
  2. per clip: frame_length/2 zeros in front (semicausal), frames of frame_length + 1 samples
     every hop_length, preemphasis (when set) leaving frame_length samples, a periodic Hann
     window, |rfft| at the next power of two (×2 with fft_overdrive), an HTK mel filter bank
     (no norm), log(mel + mel_floor), per-bin mean / stddev when given;
  3. a frame is valid when its last sample is real audio (the mask); invalid frames are zeroed.
Soft tokens of a clip: its mask through the audio tower's two stride-2 subsampling convolutions
(`soft_tokens`), what the processor expands its placeholder to.

WAV files are read with scipy (PCM 8/16/24/32-bit or float; several channels averaged), scaled to
[-1, 1) as soundfile reads them; a clip at another rate than the extractor's is refused (no
resampler here equals transformers' soxr).
"""
from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from MaxText.data.multimodal.errors import MediaError


@dataclass(frozen=True)
class AudioConfig:
  """The feature extractor's settings (its part of processor_config.json /
  preprocessor_config.json; transformers' defaults)."""
  feature_size: int = 128
  sampling_rate: int = 16_000
  padding_value: float = 0.0
  frame_length_ms: float = 20.0
  hop_length_ms: float = 10.0
  min_frequency: float = 0.0
  max_frequency: float = 8000.0
  preemphasis: float = 0.0
  preemphasis_htk_flavor: bool = True
  fft_overdrive: bool = False
  dither: float = 0.0
  input_scale_factor: float = 1.0
  mel_floor: float = 1e-3
  per_bin_mean: tuple[float, ...] | None = None
  per_bin_stddev: tuple[float, ...] | None = None
  padding_side: str = "right"
  max_length: int = 480_000            # the processor's call defaults (30 s at 16 kHz)
  pad_to_multiple_of: int = 128

  @classmethod
  def from_dict(cls, values: dict[str, Any], where: str) -> "AudioConfig":
    known = {k: values[k] for k in cls.__dataclass_fields__ if values.get(k) is not None}
    for k in ("per_bin_mean", "per_bin_stddev"):
      if k in known:
        known[k] = tuple(float(x) for x in known[k])
    cfg = cls(**known)
    if cfg.padding_side not in ("right", "left"):
      raise ValueError(f"{where}: padding_side={cfg.padding_side!r} must be right or left")
    return cfg

  @property
  def frame_length(self) -> int:
    return int(round(self.sampling_rate * self.frame_length_ms / 1000.0))

  @property
  def hop_length(self) -> int:
    return int(round(self.sampling_rate * self.hop_length_ms / 1000.0))

  @property
  def fft_length(self) -> int:
    return 2 ** math.ceil(math.log2(self.frame_length)) * (2 if self.fft_overdrive else 1)


def mel_filters(cfg: AudioConfig) -> np.ndarray:
  """[fft_length/2 + 1, feature_size] float64: triangular HTK-mel filters, no norm
  (transformers' `audio_utils.mel_filter_bank(norm=None, mel_scale="htk")`)."""
  to_mel = lambda f: 2595.0 * np.log10(1.0 + f / 700.0)
  mels = np.linspace(to_mel(cfg.min_frequency), to_mel(cfg.max_frequency), cfg.feature_size + 2)
  centres = 700.0 * (np.power(10, mels / 2595.0) - 1.0)
  fft_freqs = np.linspace(0, cfg.sampling_rate // 2, cfg.fft_length // 2 + 1)
  diff = np.diff(centres)
  slopes = np.expand_dims(centres, 0) - np.expand_dims(fft_freqs, 1)
  down, up = -slopes[:, :-2] / diff[:-1], slopes[:, 2:] / diff[1:]
  return np.maximum(np.zeros(1), np.minimum(down, up))


def _window(length: int) -> np.ndarray:
  return np.hanning(length + 1)[:-1].astype(np.float32)     # periodic Hann


def _log_mel(waveform: np.ndarray, mask: np.ndarray, cfg: AudioConfig, filters: np.ndarray):
  """(log-mel [T, F] float32, valid [T] bool) of one padded clip (step 2 and 3)."""
  x = waveform[None, :]
  if cfg.dither > 0.0:
    x = x + cfg.dither * np.random.randn(*x.shape).astype(x.dtype)
  if cfg.input_scale_factor != 1.0:
    x = x * cfg.input_scale_factor
  pad_left = cfg.frame_length // 2
  x = np.pad(x, ((0, 0), (pad_left, 0)), mode="constant")
  mask = np.pad(mask, (pad_left, 0), mode="constant", constant_values=0)
  size, hop = cfg.frame_length + 1, cfg.hop_length
  count = (x.shape[1] - size) // hop + 1
  if count <= 0:
    frames = np.zeros((1, 0, size), x.dtype)
  else:
    frames = np.lib.stride_tricks.as_strided(x, shape=(1, count, size),
                                             strides=(x.strides[0], x.strides[1] * hop,
                                                      x.strides[1]))
  if cfg.preemphasis > 0.0:
    if cfg.preemphasis_htk_flavor:
      frames = np.concatenate([frames[..., :1] * (1.0 - cfg.preemphasis),
                               frames[..., 1:-1] - cfg.preemphasis * frames[..., :-2]], axis=-1)
    else:
      frames = frames[..., 1:] - cfg.preemphasis * frames[..., :-1]
  else:
    frames = frames[..., :-1]
  magnitude = np.abs(np.fft.rfft(frames * _window(cfg.frame_length), n=cfg.fft_length, axis=-1))
  log_mel = np.log(np.matmul(magnitude, filters) + np.array(cfg.mel_floor, dtype=np.float64))
  if cfg.per_bin_mean is not None:
    log_mel = log_mel - np.array(cfg.per_bin_mean).reshape(1, 1, cfg.feature_size)
  if cfg.per_bin_stddev is not None:
    log_mel = log_mel / np.array(cfg.per_bin_stddev).reshape(1, 1, cfg.feature_size)
  log_mel = log_mel[0]
  ends = np.arange(log_mel.shape[0]) * hop + size - 1
  valid = mask[ends].astype(bool)
  return log_mel.astype(np.float32) * valid[..., None], valid


def features(clips: Sequence[np.ndarray], cfg: AudioConfig) -> tuple[np.ndarray, np.ndarray]:
  """(input_features [A, T, F] float32, input_features_mask [A, T] bool) of a batch of clips, as
  the processor computes them for one call (module docstring)."""
  limit = -(-cfg.max_length // cfg.pad_to_multiple_of) * cfg.pad_to_multiple_of
  cut = [np.asarray(c)[:limit] for c in clips]
  longest = max(len(c) for c in cut)
  length = -(-longest // cfg.pad_to_multiple_of) * cfg.pad_to_multiple_of
  filters = mel_filters(cfg)
  feats, masks = [], []
  for c in cut:
    gap = length - len(c)
    where = (0, gap) if cfg.padding_side == "right" else (gap, 0)
    wave = np.pad(c, where, constant_values=cfg.padding_value)
    mask = np.pad(np.ones(len(c), np.int32), where)
    if wave.dtype == np.float64:
      wave = wave.astype(np.float32)
    f, m = _log_mel(wave, mask, cfg, filters)
    feats.append(f)
    masks.append(m)
  return np.stack(feats), np.stack(masks)


def soft_tokens(mask: np.ndarray) -> int:
  """A clip's audio soft tokens: its frame mask through two stride-2 convolutions (kernel 3,
  padding 1), counted (transformers' `Gemma4Processor.replace_audio_token`)."""
  for _ in range(2):
    mask = mask[::2][:(len(mask) - 1) // 2 + 1]
  return int(mask.sum())


def as_clip(source: Any, cfg: AudioConfig, what: str = "audio") -> np.ndarray:
  """A mono float waveform at the extractor's rate: a WAV file's samples, or a 1-D float array
  (float64 kept, as the processor keeps it until padding). MediaError (exit 3) naming the input."""
  if isinstance(source, (str, os.PathLike)):
    return read_wav(os.fspath(source), cfg.sampling_rate, what)
  clip = np.asarray(source)
  if clip.ndim != 1 or not np.issubdtype(clip.dtype, np.floating):
    raise MediaError(f"{what}: an audio array must be a 1-D float waveform at "
                     f"{cfg.sampling_rate} Hz, got {clip.dtype} {list(clip.shape)}")
  if not len(clip):
    raise MediaError(f"{what}: the waveform is empty")
  return clip


def read_wav(path: str, sampling_rate: int | None, what: str = "audio") -> np.ndarray:
  """A WAV file as a mono float32 waveform in [-1, 1) (module docstring); `sampling_rate` None:
  any rate (a check that the file reads)."""
  path = os.path.expanduser(path)
  if not os.path.isfile(path):
    raise MediaError(f"{what} {path} does not exist")
  return wav_samples(path, sampling_rate, f"{what} {path}")


def wav_samples(source: Any, sampling_rate: int | None, what: str) -> np.ndarray:
  """A WAV file's (a path or a binary file object) samples as a mono float32 waveform in [-1, 1);
  MediaError naming `what` when it is not one, or at another rate than `sampling_rate`."""
  from scipy.io import wavfile  # pylint: disable=import-outside-toplevel
  try:
    rate, data = wavfile.read(source)
  except (OSError, ValueError, EOFError, struct.error) as e:   # struct: a truncated header
    raise MediaError(f"{what} cannot be read as a WAV file: {e}") from None
  if data.dtype == np.uint8:
    samples = (data.astype(np.float32) - 128) / 128
  elif np.issubdtype(data.dtype, np.integer):
    samples = data.astype(np.float32) / float(2 ** (8 * data.dtype.itemsize - 1))
  else:
    samples = data.astype(np.float32)
  if samples.ndim == 2:     # [samples, channels]
    samples = samples.mean(axis=1) if np.shape(samples)[-1] > 1 else samples[:, 0]
  if sampling_rate is not None and rate != sampling_rate:
    raise MediaError(f"{what} is sampled at {rate} Hz; the model's feature extractor "
                     f"takes {sampling_rate} Hz: resample it first (e.g. sox or ffmpeg)")
  if not len(samples):
    raise MediaError(f"{what} holds no samples")
  return np.ascontiguousarray(samples, dtype=np.float32)
