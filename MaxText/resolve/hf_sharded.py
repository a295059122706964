"""A Hugging Face folder loaded straight onto the mesh: each process reads only its slices.

`load_sharded(folder, mcfg, abstract_params)` gives our parameters as jax.Arrays placed as
`abstract_params`' shardings say (the run's logical-axis rules), without a conversion step and
without any host holding the model:

- Every safetensors shard's header (8-byte length + JSON: dtype, shape, byte offsets of each
  tensor) is read once (`SafetensorsFolder`); the folder may be local or on an object store
  (`gs://…`, through fsspec / gcsfs like every other path: MaxText/storage/paths.py).
- The family's name map (`NameMap.plan`) says which HF tensor fills which block of which of our
  parameters, and how (transposed / reshaped, `name_map.to_ours`). Each parameter is made by
  `jax.make_array_from_callback`: for each slice one of this process's devices holds, the HF box
  that slice comes from is read by ranged reads (one contiguous byte range per row of the box,
  touching rows merged; devices holding the same slice share one read; on an object store the
  ranges go out concurrently through fsspec's `cat_ranges`), laid out as ours, and cast to the parameter's dtype as the in-memory
  converter casts (NumPy assignment), so both give the same bits.
- The host holds, beyond its devices' shards, one slice of one tensor at a time.
- Before anything is read, `check_folder` compares the headers with the plan: a tensor the model
  needs and no shard holds, a wrong shape, or a tensor with no place in the model raise
  HFFolderError naming it (the tools exit 4 before compiling).

A family whose map is not a single `NameMap` (a map that picks its layout from the tensor names,
or needs to skip a tower's tensors) has no `NAME_MAP` used by its `hf_to_params`; `sharded_map`
returns None for it and the tools convert it in memory on each host instead (to_maxtext.load_hf).
With tied embeddings a folder's `lm_head.weight` is not compared with the embedding here (that
needs whole tensors); the in-memory converter compares them.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Iterable

import jax
import ml_dtypes
import numpy as np

from MaxText.checkpoint.errors import CheckpointError
from MaxText.models.model_config import ModelConfig
from MaxText.models.name_map import Entry, NameMap, Rule, flatten, split_path, unflatten
from MaxText.storage import paths

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
          "BOOL": np.bool_, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"
FETCH_BATCH = 1024   # ranged GETs in flight at once on an object store
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")   # never read
MERGE_GAP = 0   # rows of a box this close are read as one range (0: only touching rows)


class HFFolderError(CheckpointError):
  """A Hugging Face folder whose tensors do not make the model (exit 4), naming the file and
  tensor."""


@dataclass
class ReadStats:
  """What this process read of the folder: ranged reads and their bytes (headers apart)."""
  reads: int = 0
  bytes: int = 0
  header_bytes: int = 0


@dataclass(frozen=True)
class TensorInfo:
  file: str
  dtype: Any
  shape: tuple[int, ...]
  start: int       # absolute byte offset of the data in `file`


@dataclass
class SafetensorsFolder:
  """The tensors of a folder's safetensors shard(s), from their headers; `read(name, box)` reads
  one box (a tuple of slices) of a tensor by ranged reads."""
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

  def read(self, name: str, box: tuple[slice, ...]) -> np.ndarray:
    """The box `box` (one slice per axis, steps of 1) of tensor `name`."""
    info = self.tensors[name]
    shape = info.shape
    lo = [s.start for s in box]
    hi = [s.stop for s in box]
    out_shape = tuple(h - low for low, h in zip(lo, hi))
    out = np.empty(out_shape, info.dtype)
    if not shape:
      return self._ranges(info, [(0, info.dtype.itemsize)]).view(info.dtype).reshape(())
    if 0 in out_shape:
      return out
    # the last axis that is not whole: each row of the box over the axes up to it is one run
    k = max((d for d in range(len(shape)) if (lo[d], hi[d]) != (0, shape[d])), default=0)
    inner = math.prod(shape[k + 1:])
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    run = (hi[k] - lo[k]) * inner
    starts = [sum(i * s for i, s in zip(idx, strides)) + lo[k] * strides[k]
              for idx in np.ndindex(*out_shape[:k])] if k else [lo[0] * strides[0]]
    if k:
      starts = [st + sum(low * s for low, s in zip(lo[:k], strides[:k])) for st in starts]
    item = info.dtype.itemsize
    data = self._ranges(info, [(st * item, run * item) for st in starts])
    return data.view(info.dtype).reshape(out_shape)

  def _ranges(self, info: TensorInfo, ranges: list[tuple[int, int]]) -> np.ndarray:
    """The bytes of `ranges` ((offset in the tensor, length), ascending) concatenated; ranges
    closer than MERGE_GAP are fetched as one read."""
    out = np.empty(sum(n for _, n in ranges), np.uint8)
    groups: list[list[tuple[int, int]]] = []
    for r in ranges:
      if groups and r[0] - sum(groups[-1][-1]) <= MERGE_GAP:
        groups[-1].append(r)
      else:
        groups.append([r])
    spans = [(info.start + g[0][0], info.start + sum(g[-1])) for g in groups]
    pos = 0
    for group, buf in zip(groups, self._fetch(info.file, spans)):
      first, end = group[0][0], sum(group[-1])
      if len(buf) != end - first:
        raise HFFolderError(f"{info.file}: short read (the file is truncated)")
      self.stats.reads += 1
      self.stats.bytes += end - first
      view = np.frombuffer(buf, np.uint8)
      for off, n in group:
        out[pos:pos + n] = view[off - first:off - first + n]
        pos += n
    return out

  @staticmethod
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
    for i in range(0, len(spans), FETCH_BATCH):
      batch = spans[i:i + FETCH_BATCH]
      yield from fs.cat_ranges([p] * len(batch), [a for a, _ in batch], [b for _, b in batch])


def sharded_map(hf_map: ModuleType) -> NameMap | None:
  """The family's `NameMap` when its `hf_to_params` is that map's (module docstring), else None."""
  nm = getattr(hf_map, "NAME_MAP", None)
  fn = getattr(hf_map, "hf_to_params", None)
  if isinstance(nm, NameMap) and getattr(fn, "__self__", None) is nm:
    return nm
  return None


def _hf_shape(rule: Rule, block: tuple[int, ...]) -> tuple[int, ...]:
  if rule.in_rank is None:
    return tuple(block)
  lead, body = block[: rule.lead], block[rule.lead:]
  return (*lead, math.prod(body[rule.in_rank:]), math.prod(body[: rule.in_rank]))


def _block(index: tuple, shape: tuple[int, ...]) -> list[tuple[int, int, bool]]:
  """Per axis of our parameter: (start, stop, dropped) of the block an `_index` tuple selects."""
  out: list[tuple[int, int, bool]] = []
  rest = list(index)
  if Ellipsis in rest:
    at = rest.index(Ellipsis)
    rest = rest[:at] + [slice(None)] * (len(shape) - len(rest) + 1) + rest[at + 1:]
  rest += [slice(None)] * (len(shape) - len(rest))
  for ix, n in zip(rest, shape):
    if isinstance(ix, slice):
      start, stop, _ = ix.indices(n)
      out.append((start, stop, False))
    else:
      out.append((int(ix), int(ix) + 1, True))
  return out


def check_folder(st: SafetensorsFolder, nm: NameMap, mcfg: ModelConfig,
                 specs: dict[tuple, Any]) -> list[Entry]:
  """The plan, after checking every tensor it needs is in the headers with the shape the model
  implies, and every tensor of the folder has a place (HFFolderError naming the first that is
  not so)."""
  nm.check(mcfg)
  plan = list(nm.plan(mcfg, specs))
  used = set()
  for e in plan:
    for name, index in e.sources:
      info = st.tensors.get(name)
      if info is None:
        raise HFFolderError(f"{st.folder}: no shard holds tensor '{name}' (for our "
                            f"{'/'.join(map(str, e.path))})")
      block = tuple(b - a for a, b, drop in _block(index, e.spec.shape) if not drop)
      want = _hf_shape(e.rule, block)
      if info.shape != want:
        raise HFFolderError(f"{info.file}: tensor '{name}' has shape {info.shape}, the model "
                            f"implies {want}")
      used.add(name)
  if mcfg.tie_word_embeddings and nm.tied_head_name in st.tensors:
    used.add(nm.tied_head_name)
  extra = sorted(n for n in set(st.tensors) - used if not n.endswith(nm.ignored_suffixes))
  if extra:
    raise HFFolderError(f"{st.folder}: tensors with no place in the model: {extra[:8]}")
  return plan


def _fill(st: SafetensorsFolder, e: Entry, want: tuple[slice, ...], dtype) -> np.ndarray:
  """This process's slice `want` (slices over our parameter's axes) of parameter `e`."""
  shape = e.spec.shape
  lo_hi = [s.indices(n)[:2] for s, n in zip(want, shape)] if want else []
  lo_hi += [(0, n) for n in shape[len(lo_hi):]]
  out = np.empty(tuple(b - a for a, b in lo_hi), dtype)
  for name, index in e.sources:
    region = _block(index, shape)
    inter = [(max(a, ra), min(b, rb)) for (a, b), (ra, rb, _) in zip(lo_hi, region)]
    if any(b <= a for a, b in inter):
      continue
    # the part of the source's block this slice needs, in the block's own axes
    sub = [(a - ra, b - ra) for (a, b), (ra, _, drop) in zip(inter, region) if not drop]
    block_shape = tuple(rb - ra for ra, rb, drop in region if not drop)
    piece = _read_block(st, name, e.rule, block_shape, sub)
    dst = tuple(slice(a - wa, b - wa) for (a, b), (wa, _) in zip(inter, lo_hi))
    out[dst] = piece.reshape(out[dst].shape)
  return out


def _axes_box(sub: list[tuple[int, int]], dims: tuple[int, ...]
              ) -> tuple[slice, tuple[slice, ...]]:
  """(the flat range of a group of axes `dims` the sub-box `sub` lies in — whole rows after the
  group's first axis — and the sub-box's slices within that range once reshaped)."""
  rest = math.prod(dims[1:])
  flat = slice(sub[0][0] * rest, sub[0][1] * rest)
  return flat, (slice(0, sub[0][1] - sub[0][0]), *(slice(a, b) for a, b in sub[1:]))


def _read_block(st: SafetensorsFolder, name: str, rule: Rule, block_shape: tuple[int, ...],
                sub: list[tuple[int, int]]) -> np.ndarray:
  """Sub-box `sub` of our block `block_shape`, made from the HF tensor `name` by `rule`."""
  if rule.in_rank is None:
    return st.read(name, tuple(slice(a, b) for a, b in sub))
  lead, body = rule.lead, block_shape[rule.lead:]
  in_dims, out_dims = body[: rule.in_rank], body[rule.in_rank:]
  in_sub, out_sub = sub[lead: lead + rule.in_rank], sub[lead + rule.in_rank:]
  in_flat, in_local = _axes_box(in_sub, in_dims)
  out_flat, out_local = _axes_box(out_sub, out_dims)
  box = (*(slice(a, b) for a, b in sub[:lead]), out_flat, in_flat)
  w = st.read(name, box)                                         # [*lead, out rows, in rows]
  k = np.swapaxes(w, -1, -2)
  lead_shape = k.shape[:lead]
  k = k.reshape(*lead_shape, in_local[0].stop, *in_dims[1:], out_local[0].stop, *out_dims[1:])
  return k[(*(slice(None),) * lead, *in_local, *out_local)]


def load_sharded(folder: str, hf_map: ModuleType, mcfg: ModelConfig, abstract_params: Any,
                 st: SafetensorsFolder | None = None) -> tuple[Any, ReadStats]:
  """(our parameters as jax.Arrays placed per `abstract_params`' shardings, what this process
  read). `abstract_params`: ShapeDtypeStructs with shardings (the run's). Raises HFFolderError
  naming a missing / misshapen / extra tensor before any array is read."""
  nm = sharded_map(hf_map)
  if nm is None:
    raise ValueError(f"the name map of {getattr(hf_map, '__name__', hf_map)} is not one NameMap")
  st = st or SafetensorsFolder(folder)
  flat_abs = flatten(abstract_params)
  specs = {p: jax.ShapeDtypeStruct(s.shape, s.dtype) for p, s in flat_abs.items()}
  plan = check_folder(st, nm, mcfg, specs)
  out = {}
  for e in plan:
    target = flat_abs[e.path]
    slices: dict[tuple, np.ndarray] = {}   # devices holding the same slice share one read

    def one(idx, e=e, dt=target.dtype, slices=slices):
      key = tuple(s.indices(n)[:2] for s, n in zip(idx, e.spec.shape))
      if key not in slices:
        slices[key] = _fill(st, e, tuple(idx), dt)
      return slices[key]
    out[e.path] = jax.make_array_from_callback(tuple(target.shape), target.sharding, one)
  for name in nm.ours_only:
    path = split_path(name)
    if path in flat_abs:
      t = flat_abs[path]
      out[path] = jax.make_array_from_callback(
          tuple(t.shape), t.sharding,
          lambda idx, t=t: np.zeros(_shape_of(idx, t.shape), t.dtype))
  missing = sorted("/".join(map(str, p)) for p in set(flat_abs) - set(out))
  if missing:
    raise HFFolderError(f"{folder}: our parameters {missing[:8]} have no Hugging Face tensor")
  return unflatten(out), st.stats


def _shape_of(idx: Iterable[slice], shape: tuple[int, ...]) -> tuple[int, ...]:
  idx = list(idx) + [slice(None)] * (len(shape) - len(list(idx)))
  return tuple(len(range(*s.indices(n))) for s, n in zip(idx, shape))
