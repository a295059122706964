"""An Orbax item for the data iterator's position: one JSON file per data shard,
`shard_<s>-of-<n>.json`, holding that shard's Grain state and the fingerprint of the data config
and shard layout it belongs to. Every process writes the files of the shards it reads (processes
that read the same shard write identical files, each whole: an atomic rename, or one upload to an
object store), and a restore reads the
files of the shards it reads, whichever process wrote them: so a run saved by 2 processes resumes
on 1 or 4 as long as `data_shards` stays the same. A checkpoint without the files this process
needs, or with a state from another data config or shard layout, is refused with a DataError
(exit status 3) rather than silently restarting the stream at record 0."""
from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any

import orbax.checkpoint as ocp
from etils import epath

from MaxText.data.errors import DataError
from MaxText.storage import paths

ITEM = "data"
_NAME = re.compile(r"shard_(\d+)-of-(\d+)\.json$")


def filename(shard: int, num_shards: int) -> str:
  return f"shard_{shard}-of-{num_shards}.json"


def _listing(item_dir: str) -> list[str]:
  return sorted(paths.listdir(item_dir))


def saved_num_shards(step_dir: str) -> int | None:
  """The `data_shards` a checkpoint step was saved with (None: no data state in it)."""
  counts = {int(m.group(2)) for m in map(_NAME.match, _listing(paths.join(step_dir, ITEM))) if m}
  return max(counts) if counts else None


def require_state(step_dir: str, step: int, iterator: Any) -> None:
  """DataError unless the checkpoint at `step_dir` holds the state of every shard `iterator`
  reads."""
  item_dir = paths.join(step_dir, ITEM)
  names = [filename(s, iterator.num_shards) for s in iterator.shard_ids]
  listed = set(_listing(item_dir))
  missing = [n for n in names if n not in listed]
  if not missing:
    return
  found = [f for f in _listing(item_dir) if _NAME.match(f)]
  raise DataError(
      f"checkpoint step {step} has no data iterator state for data shard(s) "
      f"{', '.join(missing)} ({item_dir}"
      + (f" has {', '.join(found)}" if found else " has none") + "); refusing to restart the "
      "data stream at record 0 (resume with the data config and data_shards it was saved with)")


class DataStateHandler(ocp.CheckpointHandler):
  def save(self, directory: epath.Path, args: "DataStateSave") -> None:
    it = args.iterator
    state = it.get_state()
    for s in it.shard_ids:
      text = json.dumps({"grain": state["shards"][str(s)], "fingerprint": state["fingerprint"]},
                        sort_keys=True)
      paths.write_text(paths.join(os.fspath(directory), filename(s, it.num_shards)), text)

  def restore(self, directory: epath.Path, args: "DataStateRestore") -> Any:
    it = args.iterator
    shards, fingerprint = {}, None
    for s in it.shard_ids:
      path = directory / filename(s, it.num_shards)
      if not path.exists():
        raise DataError(f"checkpoint has no data iterator state for data shard {s}: {path}")
      try:
        saved = json.loads(path.read_text())
        shards[str(s)], fingerprint = saved["grain"], saved.get("fingerprint")
      except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"data iterator state {path} is not a saved shard state: "
                        f"{type(e).__name__}: {e}") from e
    it.set_state({"shards": shards, "fingerprint": fingerprint})
    return it

  def metadata(self, directory: epath.Path) -> None:
    return None


@ocp.args.register_with_handler(DataStateHandler, for_save=True)
@dataclasses.dataclass
class DataStateSave(ocp.args.CheckpointArgs):
  iterator: Any


@ocp.args.register_with_handler(DataStateHandler, for_restore=True)
@dataclasses.dataclass
class DataStateRestore(ocp.args.CheckpointArgs):
  iterator: Any
