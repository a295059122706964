"""A Hugging Face folder loaded straight onto the mesh: each process reads only its slices.

`load_sharded(folder, hf_map, mcfg, abstract_params)` gives our parameters as jax.Arrays placed as
`abstract_params`' shardings say (the run's logical-axis rules), without a conversion step and
without any host holding the model:

- The shards' headers are read once (`SafetensorsFolder`, resolve/safetensors_reads.py); the
  folder may be local or on an object store (`gs://…`).
- The family's `folder_map(names, mcfg)` (a `FolderMap`: the `NameMap` its `hf_to_params` would
  use for this folder, the names it renames, skips or lays out anew; a family whose
  `hf_to_params` is one `NameMap`'s needs none) says which HF tensor fills which block of which
  of our parameters, and how (transposed / reshaped, `name_map.to_ours`). Every family's maps are
  read this way.
- For each parameter, each slice this process's devices hold is cut into the boxes of the HF
  tensors it comes from; the boxes' byte ranges are fetched one source tensor (for all the
  slices) or a window of smaller ones (`READ_WINDOW` bytes) at a time, ranges that touch read as
  one (`SafetensorsFolder.fetch`: the slices of one tensor held side by side by the process's
  devices, consecutive tensors read whole), laid out as ours and cast to the parameter's dtype as
  the in-memory converter casts (NumPy assignment), so both give the same bits. The parameter is
  then made by `jax.make_array_from_callback`. The host holds, beyond its devices' shards, the
  boxes of one source tensor (or of one window) and one read (at most READ_SPAN bytes).
- Before anything is read, `check_folder` compares the headers with the plan: a tensor the model
  needs and no shard holds, a wrong shape, or a tensor with no place in the model raise
  HFFolderError naming it (the tools exit 4 before compiling).
- Tied embeddings, as the in-memory converter: a folder without `lm_head.weight` ties; one with
  it ties when it equals the embedding and is refused naming it otherwise. Each process compares
  the rows of the two it reads (the embedding's own slices), and the processes agree on the
  verdict before any of them raises.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Iterable, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from MaxText.models.model_config import ModelConfig
from MaxText.models.name_map import (Entry, FolderMap, NameMap, Rule, flatten, split_path,
                                     unflatten)
from MaxText.resolve.safetensors_reads import (HFFolderError, ReadStats, Request,
                                               SafetensorsFolder)

__all__ = ["HFFolderError", "ReadStats", "SafetensorsFolder", "check_folder", "flatten",
           "folder_map", "load_sharded", "reads_sharded"]
READ_WINDOW = 64 << 20   # bytes of ranges fetched together (more when one source tensor's are)


def _one_map(hf_map: ModuleType) -> NameMap | None:
  """The family's `NameMap` when its `hf_to_params` is that map's, else None."""
  nm = getattr(hf_map, "NAME_MAP", None)
  fn = getattr(hf_map, "hf_to_params", None)
  if isinstance(nm, NameMap) and getattr(fn, "__self__", None) is nm:
    return nm
  return None


def reads_sharded(hf_map: ModuleType) -> bool:
  """Whether a family's map can be read a box at a time (a `folder_map`, or one `NameMap`)."""
  return callable(getattr(hf_map, "folder_map", None)) or _one_map(hf_map) is not None


def folder_map(hf_map: ModuleType, names: Iterable[str], mcfg: ModelConfig) -> FolderMap:
  """The family's `FolderMap` for a folder holding tensors `names` (module docstring)."""
  fn = getattr(hf_map, "folder_map", None)
  if callable(fn):
    fm = fn(list(names), mcfg)
    assert isinstance(fm, FolderMap), fm
    return fm
  nm = _one_map(hf_map)
  if nm is None:
    raise ValueError(f"the name map of {getattr(hf_map, '__name__', hf_map)} cannot be read a box "
                     f"at a time (it has no folder_map)")
  return FolderMap(nm)


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


def _axes_box(sub: list[tuple[int, int]], dims: tuple[int, ...]
              ) -> tuple[slice, tuple[slice, ...]]:
  """(the flat range of a group of axes `dims` the sub-box `sub` lies in — whole rows after the
  group's first axis — and the sub-box's slices within that range once reshaped)."""
  rest = math.prod(dims[1:])
  flat = slice(sub[0][0] * rest, sub[0][1] * rest)
  return flat, (slice(0, sub[0][1] - sub[0][0]), *(slice(a, b) for a, b in sub[1:]))

def _view_shape(st: SafetensorsFolder, fm: FolderMap, fname: str) -> tuple[int, ...]:
  """A folder tensor's shape as the map sees it (after `relayout`)."""
  shape = st.tensors[fname].shape
  fix = fm.relayout(fname, shape)
  return shape if fix is None else tuple(fix[1])


def _tied(st: SafetensorsFolder, fm: FolderMap, mcfg: ModelConfig) -> tuple[str, str] | None:
  """(the folder's head, its embedding) when the model ties them and the folder has a head the
  converter would compare, else None."""
  nm = fm.name_map
  head, emb = fm.rename(nm.tied_head_name), fm.rename(nm.embedding_name)
  if mcfg.tie_word_embeddings and head in st.tensors and not fm.ignore(head):
    return head, emb
  return None


def check_folder(st: SafetensorsFolder, fm: FolderMap, mcfg: ModelConfig,
                 specs: dict[tuple, Any]) -> list[Entry]:
  """The plan, after checking every tensor it needs is in the headers with the shape the model
  implies, and every tensor of the folder has a place (HFFolderError naming the first that is
  not so)."""
  nm = fm.name_map
  nm.check(mcfg)
  plan = list(nm.plan(mcfg, specs))
  used = set()
  for e in plan:
    for name, index in e.sources:
      fname = fm.rename(name)
      info = st.tensors.get(fname)
      if info is None or fm.ignore(fname):
        raise HFFolderError(f"{st.folder}: no shard holds tensor '{fname}' (for our "
                            f"{'/'.join(map(str, e.path))})")
      block = tuple(b - a for a, b, drop in _block(index, e.spec.shape) if not drop)
      want, have = _hf_shape(e.rule, block), _view_shape(st, fm, fname)
      if have != want:
        raise HFFolderError(f"{info.file}: tensor '{fname}' has shape {info.shape}, the model "
                            f"implies {want}")
      used.add(fname)
  tied = _tied(st, fm, mcfg)
  if tied is not None:
    head, emb = tied
    if emb not in st.tensors or st.tensors[head].shape != st.tensors[emb].shape:
      raise HFFolderError(f"{st.tensors[head].file}: tie_word_embeddings=true but {head} differs "
                          f"from the embedding (shape {st.tensors[head].shape})")
    used.add(head)
  extra = sorted(n for n in set(st.tensors) - used
                 if not (n.endswith(nm.ignored_suffixes) or fm.ignore(n)))
  if extra:
    raise HFFolderError(f"{st.folder}: tensors with no place in the model: {extra[:8]}")
  return plan


@dataclass
class _Job:
  """Boxes to fetch together and what to do with them once read."""
  requests: tuple[Request, ...]
  apply: Callable[[Sequence[np.ndarray]], None]
  owner: tuple        # the parameter it fills

  @property
  def nbytes(self) -> int:
    return sum(n for r in self.requests for _, n in r.ranges)


def _source_box(st: SafetensorsFolder, fm: FolderMap, fname: str, rule: Rule,
                block_shape: tuple[int, ...], sub: list[tuple[int, int]]
                ) -> tuple[tuple[slice, ...], Callable[[np.ndarray], np.ndarray]]:
  """(the box of folder tensor `fname` to read for sub-box `sub` of our block `block_shape`, made
  from it by `rule`; the function turning that box into the sub-box)."""
  if rule.in_rank is None:
    box = tuple(slice(a, b) for a, b in sub)

    def post(w):
      return w
  else:
    lead, body = rule.lead, block_shape[rule.lead:]
    in_dims, out_dims = body[: rule.in_rank], body[rule.in_rank:]
    in_sub, out_sub = sub[lead: lead + rule.in_rank], sub[lead + rule.in_rank:]
    in_flat, in_local = _axes_box(in_sub, in_dims)
    out_flat, out_local = _axes_box(out_sub, out_dims)
    box = (*(slice(a, b) for a, b in sub[:lead]), out_flat, in_flat)

    def post(w):                                           # [*lead, out rows, in rows]
      k = np.swapaxes(w, -1, -2)
      k = k.reshape(*k.shape[:lead], in_local[0].stop, *in_dims[1:], out_local[0].stop,
                    *out_dims[1:])
      return k[(*(slice(None),) * lead, *in_local, *out_local)]
  info = st.tensors[fname]
  fix = fm.relayout(fname, info.shape)
  if fix is None:
    return box, post
  relay = fix[0]   # a tensor laid out anew: read whole, laid out, then boxed
  return tuple(slice(0, n) for n in info.shape), lambda w: post(relay(w)[box])


def _source_jobs(st: SafetensorsFolder, fm: FolderMap, e: Entry, source: tuple[str, tuple],
                 held: dict[tuple, np.ndarray], tied: tuple[str, str] | None, verdict: list[bool]
                 ) -> list[_Job]:
  """The reads filling, from one of parameter `e`'s sources, each of this process's slices of it
  (`held`: slice's (start, stop) per axis → its array)."""
  shape = e.spec.shape
  name, index = source
  fname = fm.rename(name)
  region = _block(index, shape)
  block_shape = tuple(rb - ra for ra, rb, drop in region if not drop)
  jobs = []
  for lo_hi, out in held.items():
    inter = [(max(a, ra), min(b, rb)) for (a, b), (ra, rb, _) in zip(lo_hi, region)]
    if any(b <= a for a, b in inter):
      continue
    # the part of the source's block this slice needs, in the block's own axes
    sub = [(a - ra, b - ra) for (a, b), (ra, _, drop) in zip(inter, region) if not drop]
    box, post = _source_box(st, fm, fname, e.rule, block_shape, sub)
    requests = (st.box_request(fname, box),)
    if tied is not None and fname == tied[1]:
      # the same box of the head, compared raw with the embedding's as the converter compares
      requests += (st.box_request(tied[0], box),)
    dst = tuple(slice(a - wa, b - wa) for (a, b), (wa, _) in zip(inter, lo_hi))

    def put(arrays, post=post, dst=dst, out=out):
      out[dst] = post(arrays[0]).reshape(out[dst].shape)
      if len(arrays) > 1 and not np.array_equal(arrays[0], arrays[1]):
        verdict.append(False)
    jobs.append(_Job(requests, put, e.path))
  return jobs


def _given(idx: Sequence[slice] | None) -> Sequence[slice]:
  """`jax.make_array_from_callback`'s index: typed Optional, but jax asserts it is not None before
  it calls the callback."""
  if idx is None:
    raise ValueError("make_array_from_callback gave no index")
  return idx


def _lo_hi(idx: Sequence[slice], shape: tuple[int, ...]) -> list[tuple[int, int]]:
  idx = list(idx) + [slice(None)] * (len(shape) - len(idx))
  return [s.indices(n)[:2] for s, n in zip(idx, shape)]


def load_sharded(folder: str, hf_map: ModuleType, mcfg: ModelConfig, abstract_params: Any,
                 st: SafetensorsFolder | None = None) -> tuple[Any, ReadStats]:
  """(our parameters as jax.Arrays placed per `abstract_params`' shardings, what this process
  read). `abstract_params`: ShapeDtypeStructs with shardings (the run's). Raises HFFolderError
  naming a missing / misshapen / extra tensor before any array is read, or a tied head that
  differs from the embedding once read (on every process)."""
  st = st or SafetensorsFolder(folder)
  fm = folder_map(hf_map, st.tensors, mcfg)
  flat_abs = flatten(abstract_params)
  specs = {p: jax.ShapeDtypeStruct(s.shape, s.dtype) for p, s in flat_abs.items()}
  plan = check_folder(st, fm, mcfg, specs)
  tied = _tied(st, fm, mcfg)
  verdict: list[bool] = []
  out: dict[tuple, Any] = {}
  slices: dict[tuple, dict[tuple, np.ndarray]] = {}   # parameter → its slices here, by position
  left: dict[tuple, int] = {}                         # parameter → its jobs not done yet
  pending: list[_Job] = []
  window = [0]                                        # bytes of the pending jobs' ranges

  def finish(path: tuple) -> None:
    t, held = flat_abs[path], slices.pop(path)
    out[path] = jax.make_array_from_callback(
        tuple(t.shape), t.sharding, lambda idx: held[tuple(_lo_hi(_given(idx), tuple(t.shape)))])

  def flush() -> None:
    arrays = iter(st.fetch([r for j in pending for r in j.requests]))
    for job in pending:
      job.apply([next(arrays) for _ in job.requests])
      left[job.owner] -= 1
      if not left[job.owner]:
        finish(job.owner)
    pending.clear()
    window[0] = 0

  for e in plan:
    t = flat_abs[e.path]
    shape = tuple(t.shape)
    held = slices[e.path] = {}   # devices holding the same slice share it (and its reads)
    for idx in t.sharding.addressable_devices_indices_map(shape).values():
      key = tuple(_lo_hi(idx, shape))
      if key not in held:
        held[key] = np.empty(tuple(b - a for a, b in key), t.dtype)
    # one source tensor's reads for all the slices at a time, so that the slices' touching
    # ranges are in one window; a window closes between sources
    left[e.path] = 1   # until its last source's jobs are made
    for source in e.sources:
      unit = _source_jobs(st, fm, e, source, held, tied, verdict)
      left[e.path] += len(unit)
      pending.extend(unit)
      window[0] += sum(job.nbytes for job in unit)
      if window[0] >= READ_WINDOW:
        flush()
    left[e.path] -= 1
    if not left[e.path]:
      finish(e.path)
  if pending:
    flush()
  for name in fm.name_map.ours_only:
    path = split_path(name)
    if path in flat_abs:
      t = flat_abs[path]
      out[path] = jax.make_array_from_callback(
          tuple(t.shape), t.sharding,
          lambda idx, t=t: np.zeros(_shape_of(_given(idx), t.shape), t.dtype))
  if tied is not None:
    differs = bool(verdict)
    if jax.process_count() > 1:   # every process raises, or none does
      differs = bool(np.any(multihost_utils.process_allgather(np.int32(differs))))
    if differs:
      raise HFFolderError(f"{st.tensors[tied[0]].file}: tie_word_embeddings=true but {tied[0]} "
                          f"differs from the embedding")
  missing = sorted("/".join(map(str, p)) for p in set(flat_abs) - set(out))
  if missing:
    raise HFFolderError(f"{folder}: our parameters {missing[:8]} have no Hugging Face tensor")
  return unflatten(out), st.stats


def _shape_of(idx: Iterable[slice], shape: tuple[int, ...]) -> tuple[int, ...]:
  idx = list(idx) + [slice(None)] * (len(shape) - len(list(idx)))
  return tuple(len(range(*s.indices(n))) for s, n in zip(idx, shape))
