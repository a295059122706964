"""The run directory `<base_output_directory>/<run_name>/`: its name, a write check before anything
compiles, and the lock that keeps two runs from sharing it.

The lock is the file `run.lock` (JSON: host, pid, the process's start time, when, the command),
created only if absent by process 0 of a run and removed when the run ends, whatever its exit
status: locally with O_EXCL; on an object store (`base_output_directory=gs://…`) as an object
uploaded with a generation precondition (`storage.paths.create_new`), atomic there too.
A second run with the same directory exits 2 naming the holder. A lock left by a process that no
longer runs (kill -9, a crash of the machine's power aside: same host, pid gone or reused by a
later process) is taken over and the take-over is logged; `RunLock.taken_over` keeps that holder
(so the run can say that metrics rows after its last checkpoint were written by a run that died).
A lock held from another host cannot be checked from here: the run refuses and says to delete the
file if that run is dead.
"""
from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import uuid
from typing import Callable

import psutil

from MaxText.config.load import ConfigError
from MaxText.config.schema import Config
from MaxText.storage import paths

LOCK_NAME = "run.lock"


def run_dir_of(cfg: Config) -> str:
  name = cfg.run_name
  if not name or name in (".", "..") or "/" in name or "\\" in name or "\x00" in name:
    raise ConfigError(f"run_name={name!r}: must be a plain directory name (no path separators)")
  return paths.join(paths.absolute(cfg.base_output_directory), name)


# the local folders the last `check_writable` created (deepest first): a run refused before it
# starts removes them again (`remove_created`), so that it leaves no empty `<run_name>/` behind
_CREATED: list[str] = []


def check_writable(cfg: Config) -> None:
  """Creates the run directory and writes (and removes) a file in it; ConfigError naming
  base_output_directory when that fails (on an object store: a bucket that does not exist, no
  permission to write, credentials missing, the store unreachable)."""
  run_dir = run_dir_of(cfg)
  probe = paths.join(run_dir, f".write-check-{uuid.uuid4().hex}")
  _CREATED[:] = _missing_folders(run_dir)
  try:
    paths.makedirs(run_dir)
    paths.write_bytes(probe, b"")
    paths.remove(probe)
  except Exception as e:  # pylint: disable=broad-except  # each store's client has its own errors
    why = getattr(e, "strerror", None) or str(e).split("\n", 1)[0][:300] or type(e).__name__
    raise ConfigError(f"base_output_directory={cfg.base_output_directory!r}: cannot write the run "
                      f"directory {run_dir} ({type(e).__name__}: {why})") from None


def _missing_folders(path: str) -> list[str]:
  """`path` and those of its parents that do not exist yet, deepest first (none on an object
  store: it has no folders)."""
  missing = []
  while path and not paths.is_url(path) and not os.path.exists(path):
    missing.append(path)
    if os.path.dirname(path) == path:
      break
    path = os.path.dirname(path)
  return missing


def remove_created() -> None:
  """After a run was refused before it started: removes the folders `check_writable` created, as
  far as they are empty (another process's, or a file written meanwhile, stays)."""
  for folder in _CREATED:
    try:
      os.rmdir(folder)
    except OSError:
      break
  _CREATED.clear()


def keep_created() -> None:
  """The run started (its lock taken): the folders are the run's."""
  _CREATED.clear()


def _this_process() -> dict:
  return {"host": socket.gethostname(), "pid": os.getpid(),
          "process_start": psutil.Process().create_time(),
          "since": datetime.datetime.now().isoformat(timespec="seconds"),
          "command": " ".join(sys.argv)[:300]}


def describe(holder: dict) -> str:
  return (f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} "
          f"(since {holder.get('since', '?')}: {holder.get('command') or '?'})")


def holder_alive(holder: dict) -> bool | None:
  """True / False for a process of this host; None when it cannot be told (another host, or a
  lock file without a readable holder)."""
  if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
    return None
  try:
    proc = psutil.Process(holder["pid"])
    if proc.status() == psutil.STATUS_ZOMBIE:
      return False
    start = holder.get("process_start")
    # the same pid with another start time is a later process that reused the number
    return start is None or abs(proc.create_time() - float(start)) < 1.0
  except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError, TypeError):
    return False


def _read(path: str) -> tuple[str, dict]:
  try:
    raw = paths.read_text(path)
  except FileNotFoundError:
    return "", {}
  try:
    holder = json.loads(raw)
  except ValueError:
    holder = {}
  return raw, holder if isinstance(holder, dict) else {}


class RunLock:
  """`RunLock(run_dir, log).acquire()` → the lock, or ConfigError naming the holder; `release()`."""

  def __init__(self, run_dir: str, log: Callable[[str], None]):
    self.path = paths.join(run_dir, LOCK_NAME)
    self.log = log
    self._content: str | None = None
    # the holder of a stale lock this run took over: a run that died without releasing it
    self.taken_over: dict | None = None

  def acquire(self) -> "RunLock":
    paths.makedirs(paths.parent(self.path))
    for _ in range(3):
      content = json.dumps(_this_process(), sort_keys=True)
      if not paths.create_new(self.path, content.encode("utf-8")):
        raw, holder = _read(self.path)
        alive = holder_alive(holder)
        if alive is False:
          self.log(f"taking over the stale run lock {self.path} of {describe(holder)}: that "
                   "process is no longer running")
          self.taken_over = holder
          if _read(self.path)[0] == raw:  # not replaced meanwhile by another run's fresh lock
            paths.remove(self.path)
          continue
        who = describe(holder) if holder else "a run whose lock file is still being written"
        dead_hint = ("; if that run is dead (it is on another host, so this cannot be checked "
                     f"here), delete {self.path}" if alive is None else "")
        raise ConfigError(
            f"run_name: the run directory {paths.parent(self.path)} is in use by {who} "
            f"(lock {self.path}): two runs there would write the same checkpoints and "
            f"metrics.jsonl; wait for it, stop it, or choose another run_name{dead_hint}") from None
      self._content = content
      return self
    raise ConfigError(f"run_name: could not take the run lock {self.path} (other runs keep "
                      "taking it)")

  def release(self) -> None:
    if self._content is not None and _read(self.path)[0] == self._content:
      paths.remove(self.path)
    self._content = None
