"""Orbax checkpoints of a run: `<run dir>/checkpoints/<step>/{params,opt_state,meta,data}`.

- `params`, `opt_state`: the train state's arrays (restored onto whatever mesh the target
  shardings describe, so a different mesh than at save time works);
- `meta`: JSON with the step and the resolved config;
- `data`: the data iterator state, one JSON file per process (`data_state.py`).
Orbax writes each step into a temporary directory and renames it when every item is committed, so
a step directory that `all_steps()` lists is complete; async saves run in the background.
"""
from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from MaxText.checkpoint.data_state import DataStateHandler, DataStateRestore, DataStateSave

ITEMS = ("params", "opt_state", "meta", "data")


class RunCheckpoints:
  def __init__(self, directory: str, *, max_to_keep: int, async_save: bool):
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, create=True, enable_async_checkpointing=async_save)
    self._mngr = ocp.CheckpointManager(
        self.directory, options=options,
        item_handlers={"params": ocp.StandardCheckpointHandler(),
                       "opt_state": ocp.StandardCheckpointHandler(),
                       "meta": ocp.JsonCheckpointHandler(),
                       "data": DataStateHandler()})

  def latest_step(self) -> int | None:
    return self._mngr.latest_step()

  def save(self, step: int, state: dict, data_iterator: Any, config: dict) -> None:
    args = {"params": ocp.args.StandardSave(state["params"]),
            "opt_state": ocp.args.StandardSave(state["opt_state"]),
            "meta": ocp.args.JsonSave({"step": int(step), "config": config})}
    if data_iterator is not None:
      args["data"] = DataStateSave(data_iterator)
    self._mngr.save(step, args=ocp.args.Composite(**args), force=True)

  def restore(self, step: int, abstract_state: dict, data_iterator: Any) -> tuple[dict, dict]:
    """Returns (state, meta); `data_iterator` is set to its saved position in place."""
    args = {"params": ocp.args.StandardRestore(abstract_state["params"]),
            "opt_state": ocp.args.StandardRestore(abstract_state["opt_state"]),
            "meta": ocp.args.JsonRestore()}
    if data_iterator is not None:
      args["data"] = DataStateRestore(data_iterator)
    out = self._mngr.restore(step, args=ocp.args.Composite(**args))
    step_array = jax.device_put(jax.numpy.asarray(step, jax.numpy.int32),
                                abstract_state["step"].sharding)
    state = {"step": step_array, "params": out["params"], "opt_state": out["opt_state"]}
    return state, out["meta"]

  def wait(self) -> None:
    self._mngr.wait_until_finished()

  def close(self) -> None:
    self._mngr.wait_until_finished()
    self._mngr.close()


def resolve_step_dir(path: str) -> str:
  """A run's `checkpoints/` directory (→ its latest committed step) or one step directory."""
  path = os.path.abspath(path)
  if not os.path.exists(path):
    raise FileNotFoundError(f"load_parameters_path '{path}' does not exist")
  if os.path.isdir(os.path.join(path, "params")):
    return path
  steps = ocp.utils.checkpoint_steps(path) if os.path.isdir(path) else []
  if not steps:
    raise FileNotFoundError(f"load_parameters_path '{path}' holds no committed checkpoint")
  return os.path.join(path, str(max(steps)))


def read_meta(path: str) -> dict:
  """The `meta` item ({"step", "config"}) of a checkpoint (see `resolve_step_dir`)."""
  meta = os.path.join(resolve_step_dir(path), "meta", "metadata")
  if not os.path.isfile(meta):
    raise FileNotFoundError(f"checkpoint '{path}' has no meta/metadata (config) item")
  with open(meta, encoding="utf-8") as f:
    return json.load(f)


def load_params(path: str, abstract_params: Any = None) -> Any:
  """Parameters only (fine-tuning), placed per `abstract_params`' shardings (None: as numpy-backed
  arrays on the default device)."""
  with ocp.StandardCheckpointer() as ckptr:
    return ckptr.restore(os.path.join(resolve_step_dir(path), "params"), abstract_params)


def save_params_only(directory: str, params: Any, config: dict, step: int = 0) -> None:
  """A checkpoint with just `params` and `meta` (what converters write); committed atomically.
  Written uncompressed, from the arrays as they are, with Orbax's write window bounded by the
  largest array: compression would stage a compressed copy of everything in flight, and the
  converters' budget is about one copy of the weights. The result restores like any checkpoint."""
  largest = max(int(a.size) * a.dtype.itemsize for a in jax.tree.leaves(params))
  window_gb = (max(largest, 64 * 10**6) + 2**20) / 10**9   # Orbax counts 10^9 bytes per "GB"
  options = ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False)
  handlers = {"params": ocp.PyTreeCheckpointHandler(save_concurrent_gb=window_gb,
                                                    use_compression=False),
              "meta": ocp.JsonCheckpointHandler()}
  with ocp.CheckpointManager(os.path.abspath(directory), options=options,
                             item_handlers=handlers) as mngr:
    mngr.save(step, args=ocp.args.Composite(params=ocp.args.PyTreeSave(params),
                                            meta=ocp.args.JsonSave({"step": step, "config": config})))
    mngr.wait_until_finished()


def load_params_host(path: str, abstract_params: Any) -> Any:
  """Parameters as NumPy arrays in exactly the structure of `abstract_params` (what converters and
  the logit check use): read straight into host memory, one copy. Orbax stores list indices as
  string keys ("0"); they are matched back to the model's integer keys, and every shape is
  checked."""
  import etils.epath
  item = etils.epath.Path(resolve_step_dir(path)) / "params"
  handler = ocp.PyTreeCheckpointHandler()
  try:
    tree = handler.metadata(item).tree
    as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    restored = handler.restore(item, args=ocp.args.PyTreeRestore(restore_args=as_numpy))
  finally:
    handler.close()

  def conform(tree: Any, abstract: Any, where: str) -> Any:
    if not isinstance(abstract, dict):
      if tuple(tree.shape) != tuple(abstract.shape):
        raise ValueError(f"checkpoint '{path}': {where} has shape {tuple(tree.shape)}, the model "
                         f"expects {tuple(abstract.shape)}")
      return tree
    if not isinstance(tree, dict) or {str(k) for k in tree} != {str(k) for k in abstract}:
      have = sorted(map(str, tree)) if isinstance(tree, dict) else type(tree).__name__
      raise ValueError(f"checkpoint '{path}': {where or 'params'} holds {have}, the model expects "
                       f"{sorted(map(str, abstract))}")
    by_name = {str(k): v for k, v in tree.items()}
    return {k: conform(by_name[str(k)], v, f"{where}/{k}" if where else str(k))
            for k, v in abstract.items()}

  return conform(restored, abstract_params, "")
