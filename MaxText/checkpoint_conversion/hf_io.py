"""Reading and writing Hugging Face model folders safely: `config.json` + safetensors only.

- Never unpickles (`*.bin`, `*.pt`, `*.pth`, `*.pkl` are refused, not read) and never runs remote
  code (a config with `auto_map` is refused).
- Shard indexes (`model.safetensors.index.json`) may only name files inside the folder.
- `HFTensors` is a lazy read-only mapping: a tensor is read from its shard when it is asked for,
  so converters hold one tensor at a time, not the whole model.
- `write_hf_folder` writes shards of at most `max_shard_bytes` to temporary names and renames them
  (index and config last), so an interrupted export never looks complete; also into a folder on an
  object store (`output_path=gs://…`).
- Both print a progress line about every tenth of the tensors (count, bytes, seconds): a large
  model takes minutes.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from typing import Iterator

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from MaxText.resolve.hf_config import hf_config_at
from MaxText.storage import paths

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class HFFolderError(ValueError):
  """A bad Hugging Face folder; the message names the file (and tensor)."""


class Progress:
  """Prints "<what>: i/N tensors, X GB (or MB), T s" about every tenth of N and at the last one."""

  def __init__(self, what: str, total: int, steps: int = 10):
    self.what, self.total = what, total
    self.every = max(1, -(-total // steps))
    self.count = self.nbytes = 0
    self.start = time.monotonic()

  def add(self, nbytes: int) -> None:
    self.count += 1
    self.nbytes += nbytes
    if self.count % self.every == 0 or self.count == self.total:
      size = (f"{self.nbytes / 1e9:.2f} GB" if self.nbytes >= 1e9 else
              f"{self.nbytes / 1e6:.2f} MB")
      print(f"{self.what}: {self.count}/{self.total} tensors, {size}, "
            f"{time.monotonic() - self.start:.0f} s", flush=True)


def _inside(folder: str, name: str) -> str:
  path = os.path.realpath(os.path.join(folder, name))
  root = os.path.realpath(folder)
  if os.path.isabs(name) or os.path.commonpath([root, path]) != root:
    raise HFFolderError(f"{os.path.join(folder, INDEX)}: shard path '{name}' escapes the model folder")
  return path


def read_config(folder: str) -> dict:
  """`folder`'s config.json, checked (resolve/hf_config.py: hf_config_at); HFFolderError naming it."""
  try:
    return hf_config_at(os.path.join(folder, "config.json"))
  except ValueError as e:
    raise HFFolderError(str(e)) from None


class HFTensors(Mapping):
  """name → np.ndarray, read lazily from the folder's safetensors shard(s)."""

  def __init__(self, folder: str):
    self.folder = folder
    pickles = sorted(f for f in os.listdir(folder) if f.endswith(PICKLE_SUFFIXES))
    index_path = os.path.join(folder, INDEX)
    if os.path.isfile(index_path):
      with open(index_path, encoding="utf-8") as f:
        weight_map = json.load(f).get("weight_map", {})
      self._where = {name: _inside(folder, shard) for name, shard in weight_map.items()}
      for shard in sorted(set(self._where.values())):
        if not os.path.isfile(shard):
          raise HFFolderError(f"{index_path} names shard '{os.path.relpath(shard, folder)}', "
                              f"which is missing")
    elif os.path.isfile(os.path.join(folder, SINGLE)):
      single = os.path.join(folder, SINGLE)
      with safe_open(single, framework="np") as f:
        self._where = {name: single for name in f.keys()}
    else:
      extra = f" (found only pickle files {pickles}, which are never loaded)" if pickles else ""
      raise HFFolderError(f"{folder}: no {SINGLE} or {INDEX}{extra}")
    self.progress = Progress(f"reading {folder}", len(self._where))

  def __getitem__(self, name: str) -> np.ndarray:
    if name not in self._where:
      raise KeyError(f"tensor '{name}' is not in {self.folder}")
    with safe_open(self._where[name], framework="np") as f:
      if name not in f.keys():
        raise HFFolderError(f"{self._where[name]}: tensor '{name}' listed in the index is missing")
      tensor = f.get_tensor(name)
    self.progress.add(tensor.nbytes)
    return tensor

  def __iter__(self) -> Iterator[str]:
    return iter(self._where)

  def __len__(self) -> int:
    return len(self._where)


def write_hf_folder(folder: str, tensors: Mapping[str, np.ndarray], config: dict, *,
                    max_shard_bytes: int = 5 * 2**30) -> None:
  """Writes `config.json` and `model.safetensors` (or numbered shards + index). Tensors are taken
  from `tensors` one at a time and each shard is written as soon as it is full, so at most one
  shard is held in memory. `folder` may be on an object store (`gs://…`): each shard is written
  to a local temporary file, uploaded under a temporary name and deleted here, so the local disk
  holds one shard at a time; the final names (known once the count is) are given by the store's
  own copy."""
  paths.makedirs(folder)
  remote = paths.is_url(folder)
  staging = tempfile.mkdtemp(prefix="hf-shard-") if remote else folder
  written: list[tuple[str, list[str], int]] = []   # (temporary path, tensor names, bytes)
  current: dict[str, np.ndarray] = {}
  size = 0

  def flush():
    name = f".shard-{len(written):05d}.tmp"
    tmp = os.path.join(staging, name)
    save_file(current, tmp, metadata={"format": "pt"})
    if remote:
      paths.copy_file(tmp, paths.join(folder, name))
      os.remove(tmp)
      tmp = paths.join(folder, name)
    written.append((tmp, list(current), size))

  try:
    progress = Progress(f"writing {folder}", len(tensors))
    for name in tensors:
      t = np.asarray(tensors[name], order="C")   # (ascontiguousarray would make a 0-d tensor 1-d)
      progress.add(t.nbytes)
      if current and size + t.nbytes > max_shard_bytes:
        flush()
        current, size = {}, 0
      current[name] = t
      size += t.nbytes
    flush()
  finally:
    if remote:
      shutil.rmtree(staging, ignore_errors=True)
  n = len(written)
  final = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
  for (tmp, _, _), name in zip(written, final):
    paths.move_file(tmp, paths.join(folder, name))
  if n > 1:
    index = {"metadata": {"total_size": int(sum(b for _, _, b in written))},
             "weight_map": {t: name for (_, names, _), name in zip(written, final) for t in names}}
    write_json(paths.join(folder, INDEX), index)
  write_json(paths.join(folder, "config.json"), config)


def write_json(path: str, obj: dict) -> None:
  """Replaces `path` (local or on an object store) whole."""
  paths.write_text(path, json.dumps(obj, indent=2, sort_keys=True))
