"""Paths that are local or on an object store (`gs://bucket/…`, `s3://bucket/…`: any fsspec URL).

Local paths go through `os` as before; a URL through fsspec (gcsfs, s3fs), the layer Orbax's
own `etils.epath` uses for the same URLs (its arrays go through TensorStore's own drivers). An
object store has no directories and no rename: `makedirs` does nothing there, `write_bytes` is
one upload (an object appears whole or not at all, so no temporary name is needed), and
`create_new` is an upload that succeeds only if no object has the name (GCS: the generation
precondition `ifGenerationMatch=0`; S3: `If-None-Match: *`), the run lock's primitive.

gcsfs caches directory listings by default; here the same prefixes are written by TensorStore,
by other processes and by other runs, so listings are never cached (`_NO_LISTINGS_CACHE`, set for
every fsspec filesystem made after this module is imported, Orbax's included).

Clients are pointed at an emulator by their own settings: STORAGE_EMULATOR_HOST (gcsfs,
google-cloud-storage), TENSORSTORE_GCS_HTTP_URL (TensorStore's gcs driver); tests/gcs_emulator.py.
"""
from __future__ import annotations

import os
import posixpath
import re
import shutil
from typing import IO, Any

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_NO_LISTINGS_CACHE = ("gcs", "gs", "s3", "s3a")


def is_url(path: str) -> bool:
  """True for `scheme://…` (an object store, or any fsspec protocol); False for a local path."""
  return bool(_URL.match(os.fspath(path)))


def scheme(path: str) -> str:
  return os.fspath(path).split("://", 1)[0].lower() if is_url(path) else ""


def absolute(path: str) -> str:
  """A local path made absolute (`~` expanded); a URL as it is (its trailing "/" dropped)."""
  path = os.fspath(path)
  if is_url(path):
    return path.rstrip("/") if path.count("/") > 2 else path
  return os.path.abspath(os.path.expanduser(path))


def join(base: str, *parts: str) -> str:
  base = os.fspath(base)
  return posixpath.join(base, *parts) if is_url(base) else os.path.join(base, *parts)


def parent(path: str) -> str:
  return posixpath.dirname(path.rstrip("/")) if is_url(path) else os.path.dirname(path)


def _configure() -> None:
  import fsspec.config  # pylint: disable=import-outside-toplevel
  for protocol in _NO_LISTINGS_CACHE:
    fsspec.config.conf.setdefault(protocol, {}).setdefault("use_listings_cache", False)


_configure()


def filesystem(url: str) -> tuple[Any, str]:
  """(the fsspec filesystem of `url`, the path that filesystem names it by)."""
  import fsspec  # pylint: disable=import-outside-toplevel
  return fsspec.core.url_to_fs(url)


def _full(url: str, fs_path: str) -> str:
  return f"{scheme(url)}://{fs_path.lstrip('/')}"


# ---- queries -------------------------------------------------------------------------------------
def exists(path: str) -> bool:
  if not is_url(path):
    return os.path.exists(path)
  fs, p = filesystem(path)
  return fs.exists(p)


def isfile(path: str) -> bool:
  if not is_url(path):
    return os.path.isfile(path)
  fs, p = filesystem(path)
  return fs.isfile(p)


def isdir(path: str) -> bool:
  """A local directory; on an object store, a prefix that holds at least one object."""
  if not is_url(path):
    return os.path.isdir(path)
  fs, p = filesystem(path)
  return fs.isdir(p)


def getsize(path: str) -> int:
  if not is_url(path):
    return os.path.getsize(path)
  fs, p = filesystem(path)
  return int(fs.size(p))


def listdir(path: str) -> list[str]:
  """The names directly under `path` (files and directories / prefixes); [] when it is absent."""
  if not is_url(path):
    return os.listdir(path) if os.path.isdir(path) else []
  fs, p = filesystem(path)
  try:
    return [posixpath.basename(e.rstrip("/")) for e in fs.ls(p, detail=False)]
  except FileNotFoundError:
    return []


def files_under(root: str) -> dict[str, int]:
  """{path relative to `root` ("/"-separated): size} of every file below `root`. A file that
  vanishes between the listing and its size (another process's transient lock file, e.g. Orbax's
  `manifest.ocdbt.__lock` while the processes of a multi-process save list one directory) is not
  under `root` any more, and is left out."""
  if not is_url(root):
    out = {}
    for dirpath, _, names in os.walk(root):
      for n in names:
        full = os.path.join(dirpath, n)
        try:
          out[os.path.relpath(full, root).replace(os.sep, "/")] = os.path.getsize(full)
        except FileNotFoundError:
          continue
    return out
  fs, p = filesystem(root)
  p = p.rstrip("/")
  try:
    found = fs.find(p, detail=True)
  except FileNotFoundError:
    return {}
  return {posixpath.relpath(name, p): int(info.get("size") or 0) for name, info in found.items()
          if info.get("type") != "directory" and name.rstrip("/") != p}


def glob(pattern: str) -> list[str]:
  """Files matching a glob (`**` crosses directories), sorted; URLs stay URLs."""
  if not is_url(pattern):
    import glob as globlib  # pylint: disable=import-outside-toplevel
    return sorted(p for p in globlib.glob(pattern, recursive=True) if os.path.isfile(p))
  fs, p = filesystem(pattern)
  found = fs.glob(p, detail=True)
  return sorted(_full(pattern, name) for name, info in found.items()
                if info.get("type") != "directory")


def has_magic(path: str) -> bool:
  import glob as globlib  # pylint: disable=import-outside-toplevel
  return globlib.has_magic(path)


# ---- reading and writing -------------------------------------------------------------------------
def open_file(path: str, mode: str = "rb", **kwargs) -> IO:
  """`open` for a local path, fsspec's file for a URL (write modes upload on close)."""
  if not is_url(path):
    return open(path, mode, **kwargs)  # pylint: disable=consider-using-with,unspecified-encoding
  fs, p = filesystem(path)
  return fs.open(p, mode, **kwargs)


def read_bytes(path: str) -> bytes:
  if not is_url(path):
    with open(path, "rb") as f:
      return f.read()
  fs, p = filesystem(path)
  return fs.cat_file(p)


def read_text(path: str) -> str:
  return read_bytes(path).decode("utf-8")


def write_bytes(path: str, data: bytes) -> None:
  """Replaces `path` whole: locally through a temporary file and a rename, on an object store by
  one upload (objects appear whole)."""
  if not is_url(path):
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
      f.write(data)
    os.replace(tmp, path)
    return
  fs, p = filesystem(path)
  fs.pipe_file(p, data)


def write_text(path: str, text: str) -> None:
  write_bytes(path, text.encode("utf-8"))


def create_new(path: str, data: bytes) -> bool:
  """Writes `path` only if nothing is there: True if this call created it, False if it existed.
  Locally O_CREAT | O_EXCL (fsynced); on an object store a conditional upload (GCS
  ifGenerationMatch=0, S3 If-None-Match), atomic against every other writer of the store."""
  if not is_url(path):
    try:
      fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
      return False
    with os.fdopen(fd, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    return True
  fs, p = filesystem(path)
  try:
    fs.pipe_file(p, data, mode="create")
  except FileExistsError:
    return False
  return True


def copy_file(src: str, dst: str) -> None:
  """Copies one file between any two places (local, object store), replacing `dst` whole."""
  if not is_url(src) and not is_url(dst):
    tmp = os.path.join(os.path.dirname(dst), f".{os.path.basename(dst)}.{os.getpid()}.tmp")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)
  elif not is_url(src):
    fs, p = filesystem(dst)
    fs.put_file(src, p)
  else:
    with open_file(src, "rb") as fin, open_file(dst, "wb") as fout:
      shutil.copyfileobj(fin, fout, 16 << 20)


def move_file(src: str, dst: str) -> None:
  """os.replace locally; on an object store the store's own copy, then the old object deleted."""
  if not is_url(src):
    os.replace(src, dst)
    return
  fs, p = filesystem(src)
  fs.mv(p, filesystem(dst)[1])


def move_dir(src: str, dst: str) -> None:
  """Renames a directory locally; on an object store (no rename there) copies its objects under
  the new prefix and deletes the old ones."""
  if not is_url(src):
    os.rename(src, dst)
    return
  fs, p = filesystem(src)
  fs.mv(p, filesystem(dst)[1], recursive=True)


def makedirs(path: str) -> None:
  """Creates a local directory (and its parents); nothing on an object store (no directories)."""
  if not is_url(path):
    os.makedirs(path, exist_ok=True)


def remove(path: str, missing_ok: bool = True) -> None:
  try:
    if not is_url(path):
      os.remove(path)
    else:
      fs, p = filesystem(path)
      fs.rm_file(p)
  except FileNotFoundError:
    if not missing_ok:
      raise
