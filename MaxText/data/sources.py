"""Document sources: random-access collections of text documents as Grain MapDatasets.

* ``embedded``: the Python standard library's own ``.py`` files, one document per
  file. Zero setup, real text, identical on every machine with the same Python.
* ``file``: a file, directory or glob of text/jsonl/parquet/ArrayRecord files.

Both are random access (``len`` + index), so shuffling and checkpointing are exact.
"""

from __future__ import annotations

import bisect
import os
import sysconfig
from typing import Sequence

import grain

from MaxText.data import bad_records
from MaxText.data import file_readers
from MaxText.data.errors import DataError
from MaxText.storage import paths

EMBEDDED_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib",
                                    "__pycache__"})
EMBEDDED_MAX_FILE_BYTES = 200_000


def embedded_files() -> list[str]:
  """The stdlib ``.py`` files of this Python, sorted by path relative to the stdlib root.

  Skips ``site-packages``, ``test``/``tests``/``idlelib`` directories and files over 200 kB.
  """
  root = sysconfig.get_paths()["stdlib"]
  found = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if d not in EMBEDDED_EXCLUDED_DIRS]
    for name in filenames:
      if not name.endswith(".py"):
        continue
      path = os.path.join(dirpath, name)
      try:
        if os.path.getsize(path) > EMBEDDED_MAX_FILE_BYTES:
          continue
      except OSError:
        continue
      found.append(os.path.relpath(path, root).replace(os.sep, "/"))
  found.sort()
  return [os.path.join(root, rel) for rel in found]


def resolve_dataset_files(dataset_path: str, dataset_format: str) -> list[tuple[str, str]]:
  """Expands the `dataset_path` key into sorted ``(file, format)`` pairs.

  `dataset_path` may be a file, a directory (searched recursively; with "auto" only
  files with a known extension are taken, otherwise all non-hidden files) or a glob, local or
  on an object store (`gs://bucket/data/*.parquet`: MaxText/storage/paths.py).
  Only file names and sizes are looked at; no data is read.

  Raises:
    DataError: bad format, missing path, nothing matched, or an unknown extension
      with dataset_format="auto".
  """
  if dataset_format != "auto" and dataset_format not in file_readers.READERS:
    raise DataError(f"dataset_format '{dataset_format}' is not one of "
                    f"{['auto', *file_readers.READERS]}")
  if not dataset_path:
    raise DataError("dataset_path is empty but dataset_type 'file' needs a file, directory "
                    "or glob")
  path = dataset_path if paths.is_url(dataset_path) else os.path.expanduser(dataset_path)
  try:
    files = _expand(path, dataset_format)
  except DataError:
    raise
  except Exception as e:  # pylint: disable=broad-except  # an object store's client errors
    raise DataError(f"dataset_path '{dataset_path}' cannot be listed ({type(e).__name__}: "
                    f"{str(e).splitlines()[0][:300] if str(e) else ''})") from None
  if files is None:
    raise DataError(f"dataset_path '{dataset_path}' does not exist")
  if not files:
    if paths.isdir(path):
      raise DataError(f"dataset_path '{dataset_path}' is a directory with no dataset files")
    raise DataError(f"dataset_path '{dataset_path}' matched no files")

  resolved = []
  for f in files:
    fmt = dataset_format
    if fmt == "auto":
      fmt = file_readers.format_for_extension(f)
      if fmt is None:
        raise DataError(f"dataset_format 'auto' cannot tell the format of '{f}' from its "
                        f"extension (known: {sorted(file_readers.EXTENSION_FORMATS)}); set "
                        "dataset_format explicitly")
    resolved.append((f, fmt))
  return resolved


def _expand(path: str, dataset_format: str) -> list[str] | None:
  """The files a path names (a file; a directory's files; a glob's matches), None: nothing."""
  if paths.isfile(path):
    return [path]
  if paths.isdir(path):
    return _files_under(path, only_known_extensions=dataset_format == "auto")
  if paths.has_magic(path):
    return paths.glob(path)
  return None


def _files_under(directory: str, only_known_extensions: bool) -> list[str]:
  """The files below `directory`, hidden files and directories aside."""
  out = []
  for rel in paths.files_under(directory):
    if any(part.startswith(".") for part in rel.split("/")):
      continue
    path = paths.join(directory, rel)
    if only_known_extensions and file_readers.format_for_extension(path) is None:
      continue
    out.append(path)
  return sorted(out)


class ConcatDocuments:
  """Random-access view over several readers, in order (a Grain data source)."""

  def __init__(self, readers: Sequence):
    self.readers = list(readers)
    self.starts = [0]
    for r in self.readers:
      self.starts.append(self.starts[-1] + len(r))

  def __len__(self) -> int:
    return self.starts[-1]

  def __getitem__(self, index: int) -> str:
    if not 0 <= index < len(self):
      raise IndexError(index)
    which = bisect.bisect_right(self.starts, index) - 1
    return self.readers[which][index - self.starts[which]]

  def __repr__(self) -> str:
    return f"ConcatDocuments({len(self.readers)} files, {len(self)} docs)"


def embedded_source() -> ConcatDocuments:
  """The standard-library corpus as a data source of documents."""
  return ConcatDocuments([file_readers.TextFileReader(p) for p in embedded_files()])


def file_source(dataset_path: str, dataset_format: str, text_field: str) -> ConcatDocuments:
  """The documents of all files `dataset_path` resolves to, in sorted file order."""
  files = resolve_dataset_files(dataset_path, dataset_format)
  return ConcatDocuments([file_readers.make_reader(f, fmt, text_field) for f, fmt in files])


class Subset:
  """Documents `indices` of a source, in order (a Grain data source)."""

  def __init__(self, source, indices: Sequence[int]):
    self.source, self.indices = source, list(indices)

  def __len__(self) -> int:
    return len(self.indices)

  def __getitem__(self, index: int):
    return self.source[self.indices[index]]

  def __repr__(self) -> str:
    return f"Subset({len(self)} of {self.source!r})"


SPLITS = ("all", "train", "eval")


def held_out(num_docs: int, fraction: float) -> list[bool]:
  """Which documents `eval_split_fraction` holds out: document i when floor((i + 1) f) >
  floor(i f) — spread evenly, floor(n f) of them — the same for every run, process and shard
  count, so training (the others) never reads one."""
  return [int((i + 1) * fraction) > int(i * fraction) for i in range(num_docs)]


def split_source(source, fraction: float, split: str):
  """`split` of `source`: "all", the documents training reads ("train") or the held-out ones."""
  if split not in SPLITS:
    raise DataError(f"split {split!r} is not one of {SPLITS}")
  if split == "all" or fraction <= 0:
    if split == "eval":
      raise DataError("the held-out split needs eval_split_fraction > 0")
    return source
  out = held_out(len(source), fraction)
  picked = [i for i, h in enumerate(out) if h == (split == "eval")]
  if not picked:
    raise DataError(f"eval_split_fraction={fraction} of the {len(source)} documents leaves no "
                    f"{'held-out' if split == 'eval' else 'training'} document")
  return Subset(source, picked)


def document_dataset(dataset_type: str, dataset_path: str = "", dataset_format: str = "auto",
                     text_field: str = "text", tolerant: bool = False, *,
                     eval_split_fraction: float = 0.0, split: str = "all") -> grain.MapDataset:
  """A ``MapDataset`` of document strings for the `dataset_type` config key; with `tolerant`, an
  unreadable record is a ``bad_records.BadRecord`` instead of a DataError. `split` "train" or
  "eval" keeps the documents `eval_split_fraction` does not / does hold out (`held_out`).

  Raises:
    DataError: unknown type, bad path/format, or an empty dataset.
  """
  if dataset_type == "embedded":
    source = embedded_source()
  elif dataset_type == "file":
    source = file_source(dataset_path, dataset_format, text_field)
  else:
    raise DataError(f"dataset_type '{dataset_type}' has no documents (expected 'embedded' "
                    "or 'file')")
  if len(source) == 0:  # pylint: disable=g-explicit-length-test
    raise DataError(f"dataset_type '{dataset_type}' (dataset_path '{dataset_path}') holds no "
                    "documents")
  source = split_source(source, eval_split_fraction, split)
  if tolerant:   # (documents or BadRecords)
    return grain.MapDataset.source(bad_records.TolerantSource(source))
  return grain.MapDataset.source(source)
