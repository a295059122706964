"""The integrity manifest of a checkpoint: Orbax item `<step>/manifest/`, committed with the step.

- `manifest.json` (written by the background save): the step, the code version, the config and,
  for every array of `params` and `opt_state`, its shape, dtype and checksum (`checksum.py`, of
  the kind named by its "checksum" field: the same on any mesh);
- `<item>/files.process_<i>.json` (written by process i as soon as its own writes of that array
  item are done, before the processes meet to commit): size and SHA-256 of the files process i
  wrote (`ocdbt.process_<i>/…`, `array_metadatas/process_<i>`: the bulk of the bytes);
- `files.json` (written by process 0 in `finalize`, after every other item's files are final and
  just before Orbax commits the step): size and SHA-256 of every other file (metadata Orbax merges
  at commit, the config, data-iterator state, tokenizer, the per-process lists themselves).

So each process reads back only what it wrote; no process reads the whole checkpoint. At restore
each of the n processes verifies the files written by processes i with i % n == its index (process
0 also the shared ones), so a restore reads each file once more in all, spread over the processes.

Verification (`verify_files`, then `compare_arrays` / `start_compare` after the restore) catches
a missing or truncated file, missing metadata and any changed byte (the file digests), and names
the arrays whose values differ or cannot be read (the checksums). `checkpoint_verify=false` skips
both at restore; benchmarks/RESULTS.md has their cost.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import json
import os
import re
import subprocess
import time
from typing import Any, Callable, Protocol

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import future as ocp_future
from etils import epath

from MaxText.checkpoint import checksum
from MaxText.checkpoint.in_flight import InFlight
from MaxText.storage import paths

ITEM = "manifest"
ARRAYS_FILE = "manifest.json"
FILES_FILE = "files.json"
PROCESS_FILES = "files.process_{}.json"   # in an array item's directory
FORMAT = 1
_SKIP_FILES = ("commit_success.txt", "_CHECKPOINT_METADATA")
_CHUNK = 4 << 20
_WRITER = re.compile(r"^(?:ocdbt\.)?process_(\d+)$")


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


def build(step: int, arrays: dict[str, Any], config: dict, *, background: bool = False
          ) -> Callable[[], dict]:
  """The manifest of `arrays` ({item name: tree of jax.Array}); every process must call it. The
  checksums are started now and collected by the returned function (the background write calls
  it); `background`: as in `checksum.start_tree_checksums` (one process only: the background write
  runs off the main thread)."""
  pending = [checksum.start_tree_checksums(tree, prefix=item, background=background)
             for item, tree in arrays.items()]
  entries = {}
  for item, tree in arrays.items():
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      entries[f"{item}/{checksum.path_name(keypath)}"] = {"shape": list(leaf.shape),
                                                          "dtype": str(leaf.dtype)}
  head = {"format": FORMAT, "step": int(step), "code_version": code_version(), "config": config,
          "checksum": checksum.KIND}

  def finish() -> dict:
    for resolve in pending:
      for name, value in resolve().items():
        entries[name]["checksum"] = value
    return dict(head, arrays=entries)
  return finish


HASH = "sha256"   # OpenSSL's, with the CPU's SHA instructions where it has them; older manifests:
                  # "blake2b" (still verified)


def _digest(path: str, algorithm: str = HASH) -> str:
  h = hashlib.sha256() if algorithm == "sha256" else hashlib.blake2b(digest_size=16)
  with paths.open_file(path, "rb") as f:
    while chunk := f.read(_CHUNK):
      h.update(chunk)
  return h.hexdigest()


def _bytes_digest(data: bytes, algorithm: str = HASH) -> str:
  h = hashlib.sha256() if algorithm == "sha256" else hashlib.blake2b(digest_size=16)
  h.update(data)
  return h.hexdigest()


def writer_of(rel: str) -> int | None:
  """The process that wrote a checkpoint file (`ocdbt.process_<i>` or `process_<i>` in its path:
  array data and metadata each process writes itself), or None for files of the whole step."""
  for part in rel.split("/"):
    if m := _WRITER.match(part):
      return int(m.group(1))
  return None


def verifier_of(rel: str, num_processes: int) -> int:
  """The process of a restore with `num_processes` processes that verifies a file."""
  return (writer_of(rel) or 0) % num_processes


def _files(step_dir: str, items: tuple[str, ...]) -> dict[str, int]:
  """{path relative to the step: size} of the files of `items` (one listing per item)."""
  out = {}
  for item in items:
    out.update({f"{item}/{rel}": size
                for rel, size in paths.files_under(paths.join(step_dir, item)).items()
                if rel.rsplit("/", 1)[-1] not in _SKIP_FILES})
  return dict(sorted(out.items()))


def _parallel(fn, files: list[str]) -> list:
  with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
    return list(pool.map(fn, files))


def _digests(root: str, sizes: dict[str, int], prefix: str = "") -> dict[str, dict]:
  """{prefix + r: {bytes, sha256}} of the files `root/r` ({r: its size})."""
  rel = sorted(sizes)
  files = [paths.join(root, r) for r in rel]
  return {prefix + r: {"bytes": sizes[r], HASH: d}
          for r, d in zip(rel, _parallel(_digest, files))}


def write_own_digests(item_dir: str, item: str) -> None:
  """This process's digests of the files it wrote into an array item (called once its writes
  are done); `item_dir` may still carry Orbax's temporary name, the entries use `item`."""
  me = jax.process_index()
  mine = {r: size for r, size in paths.files_under(item_dir).items()
          if r.rsplit("/", 1)[-1] not in _SKIP_FILES and writer_of(r) == me}
  digests = _digests(item_dir, mine, prefix=f"{item}/")
  paths.write_text(paths.join(item_dir, PROCESS_FILES.format(me)),
                   json.dumps(digests, sort_keys=True))


def _process_digests(step_dir: str, items: tuple[str, ...],
                     committed: dict[str, dict] | None = None) -> dict[str, dict]:
  """The per-process digest lists of `items`, merged. With `committed` (the commit-time
  `files.json`, which digests these lists too), a list whose bytes changed since the commit, or
  one that does not hold digests, raises ValueError instead of being trusted."""
  out = {}
  for item in items:
    folder = paths.join(step_dir, item)
    for name in sorted(paths.listdir(folder)):
      if not re.fullmatch(PROCESS_FILES.format(r"\d+").replace(".", r"\."), name):
        continue
      rel, path = f"{item}/{name}", paths.join(folder, name)
      raw = paths.read_bytes(path)
      if committed is not None and rel in committed:
        entry = committed[rel]
        algorithm = HASH if HASH in entry else "blake2b"
        if len(raw) != entry["bytes"] or _bytes_digest(raw, algorithm) != entry[algorithm]:
          raise ValueError(f"{rel}: contents changed since the commit ({algorithm} differs)")
      listed = json.loads(raw)
      if not isinstance(listed, dict) or not all(
          isinstance(e, dict) and isinstance(e.get("bytes"), int) and (HASH in e or "blake2b" in e)
          for e in listed.values()):
        raise ValueError(f"{rel}: not a list of file digests")
      out.update(listed)
  return out


def file_digests(step_dir: str, items: tuple[str, ...]) -> dict[str, dict]:
  """Digests of the files of `items` not already digested by the processes that wrote them."""
  done = _process_digests(step_dir, items)
  return _digests(step_dir, {r: n for r, n in _files(step_dir, items).items() if r not in done})


def read(step_dir: str) -> dict:
  """The manifest of a committed step; raises FileNotFoundError / ValueError when unusable."""
  manifest = json.loads(paths.read_bytes(paths.join(step_dir, ITEM, ARRAYS_FILE)))
  manifest["files"] = json.loads(paths.read_bytes(paths.join(step_dir, ITEM, FILES_FILE)))
  if manifest.get("format") != FORMAT or not isinstance(manifest.get("arrays"), dict):
    raise ValueError(f"unknown manifest format {manifest.get('format')!r}")
  items = tuple(sorted({r.split("/", 1)[0] for r in manifest["files"]}))
  manifest["files"].update(_process_digests(step_dir, items, manifest["files"]))
  return manifest


def verify_files(step_dir: str, manifest: dict, items: tuple[str, ...], process: int = 0,
                 num_processes: int = 1) -> list[str]:
  """Problems with the files of `items` that process `process` of `num_processes` verifies
  (`verifier_of`): missing, truncated/grown, changed bytes, not in the manifest."""
  mine = lambda rel: rel.split("/", 1)[0] in items and verifier_of(rel, num_processes) == process
  expected = {r: e for r, e in manifest["files"].items() if mine(r)}
  found = _files(step_dir, tuple(sorted({r.split("/", 1)[0] for r in expected} | set(items))))
  problems, present = [], []
  for rel, entry in expected.items():
    if rel not in found:
      problems.append(f"{rel}: missing")
    elif found[rel] != entry["bytes"]:
      problems.append(f"{rel}: {found[rel]} bytes, {entry['bytes']} when saved "
                      "(truncated or overwritten)")
    else:
      present.append(rel)
  algorithm = lambda rel: HASH if HASH in expected[rel] else "blake2b"
  digests = _parallel(lambda rel: _digest(paths.join(step_dir, rel), algorithm(rel)), present)
  problems += [f"{rel}: contents changed ({algorithm(rel)} differs)"
               for rel, d in zip(present, digests) if d != expected[rel][algorithm(rel)]]
  problems += [f"{rel}: not in the manifest" for rel in found
               if mine(rel) and rel not in expected]
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
  return start_compare(manifest, restored)()


def start_compare(manifest: dict, restored: dict[str, Any], *, background: bool = False
                  ) -> Callable[[], list[str]]:
  """`compare_arrays` started now and finished by the returned function, with the kind of checksum
  the manifest was written with; `background`: as `checksum.start_tree_checksums` (nothing may
  donate or change the arrays before the function returns)."""
  kind = manifest.get("checksum", checksum.LEGACY_KIND)
  if kind == checksum.LEGACY_KIND:
    pending = [lambda tree=tree, item=item: checksum.legacy_tree_checksums(tree, prefix=item)
               for item, tree in restored.items()]
  elif kind == checksum.KIND:
    pending = [checksum.start_tree_checksums(tree, prefix=item, background=background)
               for item, tree in restored.items()]
  else:
    return lambda: [f"the manifest's checksums are of an unknown kind {kind!r}"]

  def finish() -> list[str]:
    problems = []
    for sums in pending:
      for name, value in sums().items():
        saved = manifest["arrays"].get(name, {}).get("checksum")
        if saved != value:
          problems.append(f"{name}: checksum {value}, {saved} when saved (values differ)")
    return problems
  return finish


class SaveHooks(Protocol):
  """Called at two points of a save (the trainer passes its test-only fault injection,
  MaxText/runtime/faults.py; by default nothing happens)."""

  def during_save_write(self, step: int) -> None:
    """In the background write of step's manifest, process 0."""

  def before_commit(self, step: int) -> None:
    """After every file of step is written and hashed, just before Orbax commits it."""


class NoHooks:
  def during_save_write(self, step: int) -> None:
    pass

  def before_commit(self, step: int) -> None:
    pass


class _ThenDigest:
  """A commit future: waits for an item's own futures (this process's writes), then digests
  what this process wrote into it."""

  def __init__(self, futures: list, digest: Callable[[], None]):
    self._futures, self._digest, self._done = futures, digest, False

  def result(self, timeout: float | None = None) -> None:
    start = time.monotonic()
    for f in self._futures:
      f.result(timeout=None if timeout is None else max(0.0, timeout - (time.monotonic() - start)))
    if not self._done:
      self._done = True
      self._digest()


class ArrayItemHandler(ocp.StandardCheckpointHandler):
  """Orbax's handler for an array item, plus: each process digests the files it wrote into the
  item as soon as they are written (`write_own_digests`), before the processes meet to commit."""

  def __init__(self, item: str):
    super().__init__()
    self._item = item
    self.in_flight = InFlight()   # the array writes, for a failed save to wait on

  async def async_save(self, directory, *args, **kwargs):
    futures = self.in_flight.add(await super().async_save(directory, *args, **kwargs))
    path = os.fspath(getattr(directory, "path", directory))
    return [_ThenDigest(futures, lambda: write_own_digests(path, self._item))]


@ocp.args.register_with_handler(ArrayItemHandler, for_save=True)
@dataclasses.dataclass
class ArraySave(ocp.args.StandardSave):
  pass


@ocp.args.register_with_handler(ArrayItemHandler, for_restore=True)
@dataclasses.dataclass
class ArrayRestore(ocp.args.StandardRestore):
  pass


class ManifestHandler(ocp.AsyncCheckpointHandler):
  """Writes `manifest.json` in the background and `files.json` in `finalize` (process 0)."""

  def __init__(self, hashed_items: tuple[str, ...], hooks: SaveHooks | None = None):
    self._hashed_items = hashed_items
    self._hooks = hooks or NoHooks()
    self._step: int | None = None   # the step being saved (set by `save`/`async_save`)
    self.in_flight = InFlight()

  def _write_now(self, directory: epath.Path, args: "ManifestSave") -> None:
    manifest = args.finish()  # waits for the checksums (on every process: frees their buffers)
    if jax.process_index() == 0:
      self._hooks.during_save_write(args.step)
      (directory / ARRAYS_FILE).write_text(json.dumps(manifest, sort_keys=True))

  async def _write(self, directory: epath.Path, args: "ManifestSave") -> None:
    self._write_now(directory, args)

  async def async_save(self, directory: epath.Path, args: "ManifestSave"):
    self._step = args.step
    return self.in_flight.add([ocp_future.CommitFutureAwaitingContractedSignals(
        self._write(directory, args), name="manifest_save")])

  def save(self, directory: epath.Path, args: "ManifestSave") -> None:
    self._step = args.step
    self._write_now(directory, args)

  def finalize(self, directory: epath.Path) -> None:
    """Runs after the other items are finalized (this item is registered last), before commit:
    digests the files the processes did not digest themselves."""
    if jax.process_index() != 0:
      return
    step_dir = os.fspath(epath.Path(directory).parent)
    digests = file_digests(step_dir, self._hashed_items)
    paths.write_text(paths.join(os.fspath(directory), FILES_FILE),
                     json.dumps(digests, sort_keys=True))
    if self._step is None:
      raise RuntimeError("ManifestHandler.finalize before a save")
    self._hooks.before_commit(self._step)

  def restore(self, directory: epath.Path, args: "ManifestRestore | None" = None) -> dict:
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
