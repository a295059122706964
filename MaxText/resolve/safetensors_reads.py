"""The tensors of a Hugging Face folder's safetensors shards, read a box at a time by ranged reads.

- `SafetensorsFolder(folder)` reads each shard's header once (8-byte length + JSON: dtype, shape,
  byte offsets of each tensor), locally or on an object store (`gs://…`, through fsspec / gcsfs
  like every other path: MaxText/storage/paths.py), and checks the index against the shards.
- `box_request(name, box)` says which byte ranges of which file hold a box (one slice per axis) of
  a tensor: one contiguous range per row of the box over the axes up to the last one not taken
  whole.
- `fetch(requests)` reads many boxes together: their ranges are grouped by shard file, sorted, and
  ranges that touch or overlap are read as one (the slices of one tensor a process's devices hold
  side by side, consecutive tensors read whole); locally by seeks, on an object store as ranged
  GETs issued concurrently through fsspec's `cat_ranges`, a batch at a time. A read is at most
  READ_SPAN bytes (a batch too) and is copied out and dropped as it arrives. `stats` counts the
  reads and their bytes.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import ml_dtypes
import numpy as np

from MaxText.checkpoint.errors import CheckpointError
from MaxText.storage import paths

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
          "BOOL": np.bool_, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"
FETCH_BATCH = 1024   # ranged GETs in flight at once on an object store
READ_SPAN = 64 << 20   # touching ranges are merged into reads of at most this many bytes
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")   # never read


class HFFolderError(CheckpointError):
  """A Hugging Face folder whose tensors do not make the model (exit 4), naming the file and
  tensor."""


@dataclass
class ReadStats:
  """What this process read of the folder: ranged reads and their bytes (headers apart), and the
  byte ranges the boxes asked for before touching ones were merged into those reads."""
  reads: int = 0
  bytes: int = 0
  header_bytes: int = 0
  ranges: int = 0


@dataclass(frozen=True)
class TensorInfo:
  file: str
  dtype: Any
  shape: tuple[int, ...]
  start: int       # absolute byte offset of the data in `file`


@dataclass(frozen=True)
class Request:
  """A box of a tensor as byte ranges of its file: `ranges` ((absolute offset, length), in the
  box's row-major order) make an array of `shape` and `dtype` once concatenated."""
  file: str
  ranges: tuple[tuple[int, int], ...]
  dtype: Any
  shape: tuple[int, ...]


@dataclass
class SafetensorsFolder:
  """The tensors of a folder's safetensors shard(s), from their headers (module docstring)."""
  folder: str
  tensors: dict[str, TensorInfo] = field(default_factory=dict)
  stats: ReadStats = field(default_factory=ReadStats)

  def __post_init__(self):
    folder = self.folder
    present = set(paths.listdir(folder))
    if INDEX in present:
      weight_map = json.loads(paths.read_bytes(paths.join(folder, INDEX))).get("weight_map", {})
      files = sorted(set(weight_map.values()))
      for f in files:
        if "/" in f or "\\" in f or f.startswith(".."):
          raise HFFolderError(f"{paths.join(folder, INDEX)}: shard path '{f}' escapes the model "
                              f"folder")
        if f not in present:
          raise HFFolderError(f"{paths.join(folder, INDEX)} names shard '{f}', which is missing")
    elif SINGLE in present:
      weight_map, files = None, [SINGLE]
    else:
      pickles = sorted(f for f in present if f.endswith(PICKLE_SUFFIXES))
      extra = f" (found only pickle files {pickles}, which are never loaded)" if pickles else ""
      raise HFFolderError(f"{folder}: no {SINGLE} or {INDEX}{extra}")
    for f in files:
      self._read_header(paths.join(folder, f))
    if weight_map is not None:
      for name, f in weight_map.items():
        info = self.tensors.get(name)
        if info is None or info.file != paths.join(folder, f):
          raise HFFolderError(f"{paths.join(folder, f)}: tensor '{name}' listed in the index is "
                              f"missing")

  def _read_header(self, path: str) -> None:
    with paths.open_file(path, "rb") as f:
      raw = f.read(8)
      if len(raw) != 8:
        raise HFFolderError(f"{path}: not a safetensors file (shorter than its header)")
      (n,) = struct.unpack("<Q", raw)
      text = f.read(n)
    if len(text) != n:
      raise HFFolderError(f"{path}: truncated safetensors header")
    self.stats.header_bytes += 8 + n
    try:
      header = json.loads(text)
    except json.JSONDecodeError as e:
      raise HFFolderError(f"{path}: unreadable safetensors header ({e})") from None
    size = paths.getsize(path)
    for name, meta in header.items():
      if name == "__metadata__":
        continue
      if meta["dtype"] not in DTYPES:
        raise HFFolderError(f"{path}: tensor '{name}' has dtype {meta['dtype']}, which is not "
                            f"supported")
      begin, end = meta["data_offsets"]
      dtype, shape = np.dtype(DTYPES[meta["dtype"]]), tuple(meta["shape"])
      if end - begin != math.prod(shape) * dtype.itemsize or 8 + n + end > size:
        raise HFFolderError(f"{path}: tensor '{name}' is truncated or its offsets are wrong")
      self.tensors[name] = TensorInfo(path, dtype, shape, 8 + n + begin)

  def box_request(self, name: str, box: Sequence[slice]) -> Request:
    """The byte ranges of box `box` (one slice per axis, steps of 1) of tensor `name`."""
    info = self.tensors[name]
    shape, item = info.shape, info.dtype.itemsize
    lo = [s.indices(n)[0] for s, n in zip(box, shape)]
    hi = [s.indices(n)[1] for s, n in zip(box, shape)]
    out_shape = tuple(h - low for low, h in zip(lo, hi))
    if not shape:
      return Request(info.file, ((info.start, item),), info.dtype, ())
    if 0 in out_shape:
      return Request(info.file, (), info.dtype, out_shape)
    # the last axis that is not whole: each row of the box over the axes up to it is one run
    k = max((d for d in range(len(shape)) if (lo[d], hi[d]) != (0, shape[d])), default=0)
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    run = (hi[k] - lo[k]) * strides[k]
    base = sum(low * s for low, s in zip(lo[:k + 1], strides[:k + 1]))
    # the rows' first elements, in the box's row-major order
    starts = base + sum(np.ix_(*(np.arange(n, dtype=np.int64) * st
                                 for n, st in zip(out_shape[:k], strides[:k]))), np.int64(0))
    offsets = (info.start + np.ravel(starts) * item).tolist()
    return Request(info.file, tuple((a, run * item) for a in offsets), info.dtype, out_shape)

  def fetch(self, requests: Sequence[Request]) -> list[np.ndarray]:
    """The arrays of `requests`, their ranges read together: per file, ranges that touch or
    overlap are one read of at most READ_SPAN bytes (unless one range is longer); each read is
    copied out and dropped as it arrives."""
    by_file: dict[str, list[tuple[int, int]]] = {}
    for r in requests:
      by_file.setdefault(r.file, []).extend((a, a + n) for a, n in r.ranges)
      self.stats.ranges += len(r.ranges)
    out = [np.empty(sum(n for _, n in r.ranges), np.uint8) for r in requests]
    for file, ranges in by_file.items():
      merged: list[list[int]] = []
      for a, b in sorted(ranges):
        if merged and a <= merged[-1][1] and max(b, merged[-1][1]) - merged[-1][0] <= READ_SPAN:
          merged[-1][1] = max(merged[-1][1], b)
        else:
          merged.append([a, b])
      starts = np.array([a for a, _ in merged], np.int64)
      # per read: (request, position in its array, offset in the read, length) of each range
      copies: list[list[tuple[int, int, int, int]]] = [[] for _ in merged]
      for k, r in enumerate(requests):
        if r.file != file or not r.ranges:
          continue
        begins = np.array([a for a, _ in r.ranges], np.int64)
        which = np.searchsorted(starts, begins, side="right") - 1   # the last read starting before
        pos = 0
        for i, a, (_, n) in zip(which.tolist(), begins.tolist(), r.ranges):
          copies[i].append((k, pos, a - merged[i][0], n))
          pos += n
      for (a, b), buf, todo in zip(merged, _fetch(file, [(a, b) for a, b in merged]), copies):
        if len(buf) != b - a:
          raise HFFolderError(f"{file}: short read (the file is truncated)")
        self.stats.reads += 1
        self.stats.bytes += b - a
        for k, pos, off, n in todo:
          out[k][pos:pos + n] = np.frombuffer(buf, np.uint8, n, off)
    return [arr.view(r.dtype).reshape(r.shape) for arr, r in zip(out, requests)]

  def read(self, name: str, box: Sequence[slice]) -> np.ndarray:
    """Box `box` of tensor `name` (one slice per axis, steps of 1)."""
    return self.fetch([self.box_request(name, box)])[0]


def _fetch(path: str, spans: list[tuple[int, int]]) -> Iterable[bytes]:
  """The bytes of each [start, end) of `path`: local seeks, or on an object store fsspec's
  `cat_ranges` (the ranged GETs issued concurrently, a batch at a time)."""
  if not paths.is_url(path):
    with open(path, "rb") as f:
      for start, end in spans:
        f.seek(start)
        yield f.read(end - start)
    return
  fs, p = paths.filesystem(path)
  i = 0
  while i < len(spans):   # a batch: at most FETCH_BATCH reads and READ_SPAN bytes (or one read)
    j, size = i + 1, spans[i][1] - spans[i][0]
    while j < len(spans) and j - i < FETCH_BATCH and size + spans[j][1] - spans[j][0] <= READ_SPAN:
      size += spans[j][1] - spans[j][0]
      j += 1
    batch, i = spans[i:j], j
    yield from fs.cat_ranges([p] * len(batch), [a for a, _ in batch], [b for _, b in batch])
