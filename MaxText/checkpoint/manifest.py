"""The integrity manifest of a checkpoint: Orbax item `<step>/manifest/`, committed with the step.

- `manifest.json` (written by the background save): the step, the code version, the config and,
  for every array of `params` and `opt_state`, its shape, dtype and checksum (`checksum.py`:
  computed on the devices, the same on any mesh);
- `files.json` (written in `finalize`, after every other item's files are final and just before
  Orbax commits the step): the size and BLAKE2b digest of every file of the other items.

Verification (`verify_files`, then `compare_arrays` after the restore) catches a missing or
truncated file, missing metadata and any changed byte (the file digests), and names the arrays
whose values differ or cannot be read (the checksums). Cost: the files are read once more on
process 0 at save and at restore (threads, about disk speed), the arrays are checksummed once on
the devices; `checkpoint_verify=false` skips both at restore.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import json
import os
import subprocess
from typing import Any, Callable, Protocol

import jax
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint._src.futures import future as ocp_future

from MaxText.checkpoint import checksum

ITEM = "manifest"
ARRAYS_FILE = "manifest.json"
FILES_FILE = "files.json"
FORMAT = 1
_SKIP_FILES = ("commit_success.txt", "_CHECKPOINT_METADATA")
_CHUNK = 4 << 20


@functools.cache
def code_version() -> dict:
  """The git commit of this code (with "+dirty" for local edits) and the library versions."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  try:
    commit = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True,
                            text=True, timeout=10, check=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    commit += "+dirty" if dirty else ""
  except (OSError, subprocess.SubprocessError):
    commit = "unknown"
  return {"git": commit, "jax": jax.__version__, "orbax": ocp.__version__}


def build(step: int, arrays: dict[str, Any], config: dict) -> Callable[[], dict]:
  """The manifest of `arrays` ({item name: tree of jax.Array}); every process must call it. The
  checksums are dispatched now and fetched by the returned function (the background write calls
  it, so the train loop does not wait for them)."""
  pending = [checksum.start_tree_checksums(tree, prefix=item) for item, tree in arrays.items()]
  entries = {}
  for item, tree in arrays.items():
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      entries[f"{item}/{checksum.path_name(keypath)}"] = {"shape": list(leaf.shape),
                                                          "dtype": str(leaf.dtype)}
  head = {"format": FORMAT, "step": int(step), "code_version": code_version(), "config": config}

  def finish() -> dict:
    for resolve in pending:
      for name, value in resolve().items():
        entries[name]["checksum"] = value
    return dict(head, arrays=entries)
  return finish


def _digest(path: str) -> str:
  h = hashlib.blake2b(digest_size=16)
  with open(path, "rb") as f:
    while chunk := f.read(_CHUNK):
      h.update(chunk)
  return h.hexdigest()


def _files(step_dir: str, items: tuple[str, ...]) -> list[str]:
  out = []
  for item in items:
    for dirpath, _, names in os.walk(os.path.join(step_dir, item)):
      out.extend(os.path.relpath(os.path.join(dirpath, n), step_dir) for n in names
                 if n not in _SKIP_FILES)
  return sorted(out)


def _parallel(fn, paths: list[str]) -> list:
  with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
    return list(pool.map(fn, paths))


def file_digests(step_dir: str, items: tuple[str, ...]) -> dict[str, dict]:
  rel = _files(step_dir, items)
  digests = _parallel(_digest, [os.path.join(step_dir, r) for r in rel])
  return {r: {"bytes": os.path.getsize(os.path.join(step_dir, r)), "blake2b": d}
          for r, d in zip(rel, digests)}


def read(step_dir: str) -> dict:
  """The manifest of a committed step; raises FileNotFoundError / ValueError when unusable."""
  with open(os.path.join(step_dir, ITEM, ARRAYS_FILE), encoding="utf-8") as f:
    manifest = json.load(f)
  with open(os.path.join(step_dir, ITEM, FILES_FILE), encoding="utf-8") as f:
    manifest["files"] = json.load(f)
  if manifest.get("format") != FORMAT or not isinstance(manifest.get("arrays"), dict):
    raise ValueError(f"unknown manifest format {manifest.get('format')!r}")
  return manifest


def verify_files(step_dir: str, manifest: dict, items: tuple[str, ...]) -> list[str]:
  """Problems with the files of `items` (missing, truncated/grown, changed bytes, unexpected)."""
  expected = {r: e for r, e in manifest["files"].items() if r.split("/", 1)[0] in items}
  problems, present = [], []
  for rel, entry in expected.items():
    path = os.path.join(step_dir, rel)
    if not os.path.isfile(path):
      problems.append(f"{rel}: missing")
    elif os.path.getsize(path) != entry["bytes"]:
      problems.append(f"{rel}: {os.path.getsize(path)} bytes, {entry['bytes']} when saved "
                      "(truncated or overwritten)")
    else:
      present.append(rel)
  digests = _parallel(_digest, [os.path.join(step_dir, r) for r in present])
  problems += [f"{rel}: contents changed (BLAKE2b differs)"
               for rel, d in zip(present, digests) if d != expected[rel]["blake2b"]]
  problems += [f"{rel}: not in the manifest" for rel in _files(step_dir, items)
               if rel not in expected]
  return problems


def check_compatible(manifest: dict, abstract: dict[str, Any]) -> list[str]:
  """Arrays whose saved shape/dtype differ from the model's (or that one side lacks)."""
  want = {}
  for item, tree in abstract.items():
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      want[f"{item}/{checksum.path_name(keypath)}"] = (list(leaf.shape), str(leaf.dtype))
  have = {k: (v["shape"], v["dtype"]) for k, v in manifest["arrays"].items()
          if k.split("/", 1)[0] in abstract}
  problems = [f"{k}: checkpoint {have[k][0]} {have[k][1]}, model {want[k][0]} {want[k][1]}"
              for k in want if k in have and want[k] != have[k]]
  problems += [f"{k}: in the model, not in the checkpoint" for k in want if k not in have]
  problems += [f"{k}: in the checkpoint, not in the model" for k in have if k not in want]
  return problems


def compare_arrays(manifest: dict, restored: dict[str, Any]) -> list[str]:
  """Restored arrays whose checksum differs from the manifest (every process must call it)."""
  problems = []
  for item, tree in restored.items():
    for name, value in checksum.tree_checksums(tree, prefix=item).items():
      saved = manifest["arrays"].get(name, {}).get("checksum")
      if saved != value:
        problems.append(f"{name}: checksum {value}, {saved} when saved (values differ)")
  return problems


class SaveHooks(Protocol):
  """Called at two points of a save (the trainer passes its test-only fault injection,
  MaxText/train/faults.py; by default nothing happens)."""

  def during_save_write(self, step: int) -> None:
    """In the background write of step's manifest, process 0."""

  def before_commit(self, step: int) -> None:
    """After every file of step is written and hashed, just before Orbax commits it."""


class NoHooks:
  def during_save_write(self, step: int) -> None:
    pass

  def before_commit(self, step: int) -> None:
    pass


class ManifestHandler(ocp.AsyncCheckpointHandler):
  """Writes `manifest.json` in the background and `files.json` in `finalize` (process 0)."""

  def __init__(self, hashed_items: tuple[str, ...], hooks: SaveHooks | None = None):
    self._hashed_items = hashed_items
    self._hooks = hooks or NoHooks()
    self._step = None

  def _write_now(self, directory: epath.Path, args: "ManifestSave") -> None:
    manifest = args.finish()  # waits for the checksums (on every process: frees their buffers)
    if jax.process_index() == 0:
      self._hooks.during_save_write(self._step)
      (directory / ARRAYS_FILE).write_text(json.dumps(manifest, sort_keys=True))

  async def _write(self, directory: epath.Path, args: "ManifestSave") -> None:
    self._write_now(directory, args)

  async def async_save(self, directory: epath.Path, args: "ManifestSave"):
    self._step = args.step
    return [ocp_future.CommitFutureAwaitingContractedSignals(
        self._write(directory, args), name="manifest_save")]

  def save(self, directory: epath.Path, args: "ManifestSave") -> None:
    self._step = args.step
    self._write_now(directory, args)

  def finalize(self, directory: epath.Path) -> None:
    """Runs after the other items are finalized (this item is registered last), before commit."""
    if jax.process_index() != 0:
      return
    step_dir = os.fspath(epath.Path(directory).parent)
    digests = file_digests(step_dir, self._hashed_items)
    (epath.Path(directory) / FILES_FILE).write_text(json.dumps(digests, sort_keys=True))
    self._hooks.before_commit(self._step)

  def restore(self, directory: epath.Path, args: "ManifestRestore" = None) -> dict:
    return read(os.fspath(epath.Path(directory).parent))

  def metadata(self, directory: epath.Path) -> None:
    return None


@ocp.args.register_with_handler(ManifestHandler, for_save=True)
@dataclasses.dataclass
class ManifestSave(ocp.args.CheckpointArgs):
  step: int
  finish: Callable[[], dict]  # `build`'s result


@ocp.args.register_with_handler(ManifestHandler, for_restore=True)
@dataclasses.dataclass
class ManifestRestore(ocp.args.CheckpointArgs):
  pass
