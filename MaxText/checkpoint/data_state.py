"""An Orbax item for the data iterator's position: one JSON file per process,
`process_<i>-of-<n>.json`, holding `iterator.get_state()` (Grain's state plus the fingerprint of the
data config it belongs to). Restoring sets the iterator in place. A checkpoint without this
process's file, or with a state from another data config or process count, is refused with a
DataError (exit status 3) rather than silently restarting the stream at record 0."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from MaxText.data.errors import DataError

ITEM = "data"


def filename() -> str:
  return f"process_{jax.process_index()}-of-{jax.process_count()}.json"


def require_state(step_dir: str, step: int) -> None:
  """DataError unless the checkpoint at `step_dir` holds this process's iterator state."""
  item_dir = os.path.join(step_dir, ITEM)
  if os.path.isfile(os.path.join(item_dir, filename())):
    return
  found = sorted(os.listdir(item_dir)) if os.path.isdir(item_dir) else []
  found = [f for f in found if f.startswith("process_")]
  raise DataError(
      f"checkpoint step {step} has no data iterator state for process {jax.process_index()} of "
      f"{jax.process_count()} ({os.path.join(item_dir, filename())} missing"
      + (f"; it has {', '.join(found)}" if found else "") + "); refusing to restart the data "
      "stream at record 0 (resume with the data config and process count it was saved with)")


class DataStateHandler(ocp.CheckpointHandler):
  def save(self, directory: epath.Path, args: "DataStateSave") -> None:
    (directory / filename()).write_text(json.dumps(args.iterator.get_state(), sort_keys=True))

  def restore(self, directory: epath.Path, args: "DataStateRestore") -> Any:
    path = directory / filename()
    if not path.exists():
      raise DataError(f"checkpoint has no data iterator state for this process: {path}")
    try:
      state = json.loads(path.read_text())
    except ValueError as e:
      raise DataError(f"data iterator state {path} is not valid JSON: {e}") from e
    args.iterator.set_state(state)
    return args.iterator

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
