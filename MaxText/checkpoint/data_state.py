"""An Orbax item for the data iterator's position: one JSON file per process,
`process_<i>-of-<n>.json`, holding `iterator.get_state()`. Restoring sets the iterator in place.
A checkpoint without this process's file is refused rather than silently restarting the stream."""
from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath


def _filename(directory: epath.Path) -> epath.Path:
  return directory / f"process_{jax.process_index()}-of-{jax.process_count()}.json"


class DataStateHandler(ocp.CheckpointHandler):
  def save(self, directory: epath.Path, args: "DataStateSave") -> None:
    _filename(directory).write_text(json.dumps(args.iterator.get_state(), sort_keys=True))

  def restore(self, directory: epath.Path, args: "DataStateRestore") -> Any:
    path = _filename(directory)
    if not path.exists():
      raise FileNotFoundError(f"checkpoint has no data iterator state for this process: {path}")
    args.iterator.set_state(json.loads(path.read_text()))
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
