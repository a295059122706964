"""Orbax checkpoints of a run: `<run dir>/checkpoints/<step>/{params,opt_state,meta,data,manifest}`.

- `params`, `opt_state`: the train state's arrays (restored onto whatever mesh the target
  shardings describe, so a different mesh than at save time works; no target is refused);
- `meta`: JSON with the step and the resolved config;
- `data`: the data iterator state, one JSON file per data shard (`data_state.py`);
- `tokenizer`: the run's tokenizer files, when it has some (`tokenizer_files.py`);
- `manifest`: shapes, dtypes and checksums of the arrays, digests of every file (`manifest.py`).

Crash safety: Orbax writes a step into `<step>.orbax-checkpoint-tmp-*` and renames it once every
item is written, so a step that `all_steps()` lists is complete; a process killed at any moment
leaves the previous committed step usable, and the temporary directory of a save that never
committed is removed when the next run starts (`cleanup_tmp_directories`). On an object store
(`gs://…`: no rename) Orbax writes the step under its final name and commits it by writing
`commit_success.txt` last; a step without that marker is not listed, and is removed the same way.
The arrays go through TensorStore's own gcs driver, the rest through etils.epath / fsspec
(MaxText/storage/paths.py); the manifest is checked the same way on either. Async saves run in the
background: `check()` (every step) raises `CheckpointError` once one failed or has not committed
within `save_timeout_s`; `wait()` bounds the wait for the commit the same way.
"""
from __future__ import annotations

import concurrent.futures
import functools
import json
import time
from typing import Any, Callable

import etils.epath
import jax
import numpy as np
import orbax.checkpoint as ocp

from MaxText.backend import compat
from MaxText.checkpoint import checksum, data_state, in_flight, manifest, tokenizer_files
from MaxText.checkpoint.data_state import DataStateHandler, DataStateRestore, DataStateSave
from MaxText.checkpoint.errors import CheckpointError
from MaxText.data.errors import DataError
from MaxText.storage import paths

ARRAY_ITEMS = ("params", "opt_state")
COMMIT_MARKER = "commit_success.txt"   # Orbax's commit of a step on an object store
HASHED_ITEMS = (*ARRAY_ITEMS, "meta", "data", tokenizer_files.ITEM)


def _why(e: BaseException) -> str:
  """One line: the exception type and the start of its message (TensorStore's spec dump cut)."""
  text = str(e).split("\n", 1)[0].split(" See full TensorStore details", 1)[0]
  return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__


def require_target_shardings(abstract: Any, what: str) -> None:
  """Refuses a restore target without shardings: Orbax would place the arrays by the mesh they
  were saved on, which on another mesh or device set is wrong or fails."""
  missing = [checksum.path_name(p) for p, leaf in
             jax.tree_util.tree_flatten_with_path(abstract)[0]
             if getattr(leaf, "sharding", None) is None]
  if abstract is None or missing:
    raise CheckpointError(
        f"refusing to restore {what} without target shardings "
        f"({'no target' if abstract is None else 'none for ' + ', '.join(missing[:3])}): the "
        "arrays would be placed as on the mesh they were saved from; pass abstract arrays with "
        "the shardings of this run's mesh (or load_params(path, None) for host numpy arrays)")


@functools.cache
def _no_replica_slices_on_one_cpu_process() -> None:
  """On one CPU process, each shard of a replicated array is written from its first replica.
  Orbax's default off GPU (`use_replica_parallel`) first cuts it into one slice per replica, on the
  devices: a compiled program per array and slice shape, traced and lowered again in every process
  (benchmarks/RESULTS.md, the test suite's section), so that replicas on several hosts share the
  writes. On one CPU process every replica is in the same host memory and this process writes every
  slice anyway. With several processes Orbax's default stays (each process writes its replicas'
  slices). The files hold the same arrays either way."""
  if jax.process_count() == 1 and jax.default_backend() == "cpu":
    compat.register_orbax_array_handler(use_replica_parallel=False)


class RunCheckpoints:
  def __init__(self, directory: str, *, max_to_keep: int, async_save: bool,
               save_timeout_s: float = 600.0, save_hooks: manifest.SaveHooks | None = None):
    _no_replica_slices_on_one_cpu_process()
    self.directory = paths.absolute(directory)
    self.save_timeout_s = float(save_timeout_s)
    self._pending: tuple[int, float] | None = None  # (step, start time) of an unconfirmed save
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, create=True, enable_async_checkpointing=async_save,
        cleanup_tmp_directories=True,
        async_options=ocp.AsyncOptions(timeout_secs=max(1, int(self.save_timeout_s))))
    handlers = {"params": manifest.ArrayItemHandler("params"),
                "opt_state": manifest.ArrayItemHandler("opt_state"),
                "meta": in_flight.JsonItemHandler(),
                "data": DataStateHandler(),
                tokenizer_files.ITEM: tokenizer_files.TokenizerFilesHandler(),
                # last: its finalize hashes the other items' final files
                manifest.ITEM: manifest.ManifestHandler(HASHED_ITEMS, save_hooks)}
    # the handlers that write in the background (the others are done when `save` returns)
    self._in_flight = [h.in_flight for h in handlers.values() if hasattr(h, "in_flight")]
    self._mngr = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

  def latest_step(self) -> int | None:
    return self._mngr.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._mngr.all_steps())

  # ---- save ----------------------------------------------------------------------------------
  def save(self, step: int, state: dict, data_iterator: Any, config: dict,
           meta: dict | None = None) -> None:
    """`meta`: more entries of the `meta` item (e.g. a LoRA run's base reference)."""
    self.wait()  # a failed or hung previous save is reported before anything new is written
    arrays = {k: state[k] for k in ARRAY_ITEMS}
    args: dict[str, ocp.args.CheckpointArgs] = {k: manifest.ArraySave(v) for k, v in arrays.items()}
    args["meta"] = in_flight.JsonItemSave({**(meta or {}), "step": int(step), "config": config})
    if data_iterator is not None:
      args["data"] = DataStateSave(data_iterator)
    tokenizer = tokenizer_files.files_for(config.get("tokenizer_type", ""),
                                          config.get("tokenizer_path", ""))
    if tokenizer:
      args[tokenizer_files.ITEM] = tokenizer_files.TokenizerFilesSave(tokenizer)
    # one process: the array checksums run on threads beside Orbax's background writes (which
    # hold the arrays until they are done too); several: before the save returns (their sums are
    # added up with a collective, which must run on every main thread in order)
    args[manifest.ITEM] = manifest.ManifestSave(int(step), manifest.build(
        step, arrays, config, background=jax.process_count() == 1))
    self._pending = (int(step), time.monotonic())
    try:
      self._mngr.save(step, args=ocp.args.Composite(**args), force=True)
    except Exception as e:  # pylint: disable=broad-except
      self._pending = None
      raise CheckpointError(f"saving checkpoint step {step} failed: {_why(e)}"
                            f"{self._settle(step, time.monotonic())}") from e

  def _confirm(self) -> None:
    assert self._pending is not None  # check() / wait() return first when nothing is pending
    step, start = self._pending
    self._pending = None
    try:
      self._mngr.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(
          f"saving checkpoint step {step} failed: {_why(e)}; step {step} was not committed "
          f"(latest committed step: {self._committed()}){self._settle(step, start)}") from e
    in_flight.wait_all(self._in_flight, 0.0)  # all ended (Orbax waited for them): forgotten

  def _settle(self, step: int, start: float) -> str:
    """After a save of `step` failed: waits until its other items' background writes ended too
    (Orbax stops waiting at the first failed one), within what is left of the save's time limit
    (`in_flight.py`), so that nothing still writes into the step's temporary directory once the
    failure is reported. Returns what the error message adds when some did not end."""
    left = self.save_timeout_s - (time.monotonic() - start)
    if in_flight.wait_all(self._in_flight, left):
      return ""
    return (f"; some of step {step}'s writes had not ended within checkpoint_save_timeout_s="
            f"{self.save_timeout_s:g} and may still be writing into its temporary directory")

  def _hung(self) -> CheckpointError:
    assert self._pending is not None
    step, start = self._pending
    return CheckpointError(
        f"checkpoint step {step} has not committed after {time.monotonic() - start:.0f} s "
        f"(checkpoint_save_timeout_s={self.save_timeout_s:g}): storage hung or too slow; step "
        f"{step} was not committed (latest committed step: {self._committed()})")

  def _committed(self) -> str:
    """The newest step committed on disk (Orbax's own list includes a save still in flight)."""
    steps = ocp.utils.checkpoint_steps(self.directory)
    return str(max(steps)) if steps else "none"

  def check(self) -> None:
    """Non-blocking: raises CheckpointError if the last save failed or is over its time limit."""
    if self._pending is None:
      return
    if self._mngr.is_saving_in_progress():
      if time.monotonic() - self._pending[1] > self.save_timeout_s:
        raise self._hung()
      return
    self._confirm()

  def wait(self) -> None:
    """Blocks until the last save committed; CheckpointError if it failed or hung."""
    if self._pending is None:
      return
    while self._mngr.is_saving_in_progress():
      if time.monotonic() - self._pending[1] > self.save_timeout_s:
        raise self._hung()
      time.sleep(0.02)
    self._confirm()

  def close(self) -> None:
    self.wait()
    self._mngr.close()

  def abandon(self) -> None:
    """After an error: closes if no save is stuck (a hung background write is left behind); the
    error being reported already says what went wrong, so nothing more is raised here."""
    try:
      self.close()
    except Exception:  # pylint: disable=broad-except
      pass

  # ---- restore -------------------------------------------------------------------------------
  def step_dir(self, step: int) -> str:
    return paths.join(self.directory, str(step))

  def restore(self, step: int, abstract_state: dict, data_iterator: Any, *,
              verify: bool = True, meanwhile: Callable[[], Any] | None = None
              ) -> tuple[dict, dict]:
    """Returns (state, meta); `data_iterator` is set to its saved position in place. With
    `verify`, the restored arrays' checksums are computed on other threads while Orbax reads the
    next item and `meanwhile()` runs (e.g. compiling the train step); nothing is returned before
    they are checked.

    Raises DataError (no or mismatched iterator state) or CheckpointError (naming the arrays or
    files that are damaged, missing or incompatible)."""
    require_target_shardings(abstract_state, f"checkpoint step {step}")
    step_dir = self.step_dir(step)
    if data_iterator is not None:
      data_state.require_state(step_dir, step, data_iterator)
    abstract = {k: abstract_state[k] for k in ARRAY_ITEMS}
    saved = _read_manifest(step_dir, step, required=verify)
    file_problems = []
    if saved is not None:
      incompatible = manifest.check_compatible(saved, abstract)
      if incompatible:
        raise CheckpointError(f"checkpoint step {step} does not fit this model: "
                              + "; ".join(incompatible[:8]))
    # the file digests are checked while Orbax reads the arrays (other cores; the same page cache)
    checking = _check_files_in_background(step_dir, saved, HASHED_ITEMS) if verify and saved \
        else None
    # with `verify`, one array item at a time, the largest first: each item's checksums run on
    # other threads while Orbax reads the next (and the last one's during `meanwhile`)
    order = sorted(abstract, key=lambda k: -sum(x.size * x.dtype.itemsize
                                                for x in jax.tree.leaves(abstract[k])))
    groups = [[item] for item in order] if verify else [order]
    out, comparing = {}, []
    try:
      for n, group in enumerate(groups):
        args: dict[str, ocp.args.CheckpointArgs] = {item: manifest.ArrayRestore(abstract[item])
                                                    for item in group}
        if n == 0:
          args["meta"] = in_flight.JsonItemRestore()
          if data_iterator is not None:
            args["data"] = DataStateRestore(data_iterator)
        restored = self._mngr.restore(step, args=ocp.args.Composite(**args))
        out.update({k: restored[k] for k in args if k != "data"})
        if verify and saved is not None:   # (with verify, a missing manifest raised above)
          comparing.append(manifest.start_compare(saved, {k: out[k] for k in group},
                                                  background=True))
    except DataError:
      raise
    except Exception as e:  # pylint: disable=broad-except
      for finish in comparing:   # the checksums' threads let go of the arrays first
        finish()
      file_problems = _file_problems(checking)
      unreadable = _unreadable_arrays(step_dir, abstract)
      raise CheckpointError(
          f"checkpoint step {step} cannot be read: "
          + "; ".join(unreadable + file_problems or [_why(e)])) from e
    if verify:
      if meanwhile is not None:
        meanwhile()
      differing = [problem for finish in comparing for problem in finish()]
      file_problems = _file_problems(checking)
      if differing or file_problems:
        raise CheckpointError(f"checkpoint step {step} is damaged: "
                              + "; ".join((differing + file_problems)[:8])
                              + ("" if differing else " (no array's values differ)"))
    step_array = jax.device_put(jax.numpy.asarray(step, jax.numpy.int32),
                                abstract_state["step"].sharding)
    state = {"step": step_array, "params": out["params"], "opt_state": out["opt_state"]}
    return state, out["meta"]

  def restore_latest(self, abstract_state: dict, data_iterator: Any, *, verify: bool,
                     fallback: bool, log: Callable[[str], None],
                     meanwhile: Callable[[], Any] | None = None) -> tuple[dict | None, int]:
    """(state, step) of the newest usable step, or (None, 0) without one. With `fallback`, a
    damaged step is logged and moved aside and the next older one is tried. `meanwhile`: as in
    `restore`, for each step tried (it should do its work once)."""
    steps = sorted(self.all_steps(), reverse=True)
    for i, step in enumerate(steps):
      try:
        state, _ = self.restore(step, abstract_state, data_iterator, verify=verify,
                                meanwhile=meanwhile)
        return state, step
      except CheckpointError as e:
        if i + 1 == len(steps):   # exit 4 says what is left to do
          why = ("no older step to fall back to" if i == 0
                 else "no older good step exists: every step was unusable")
          raise CheckpointError(f"{e} ({why}; move the checkpoints directory aside to start "
                                "afresh)") from e
        if not fallback:
          raise CheckpointError(f"{e} (checkpoint_fallback=true sets this step aside and "
                                f"restores the newest good one of the older steps "
                                f"{', '.join(map(str, steps[i + 1:]))})") from e
        aside = self._set_aside(step)
        log(f"checkpoint step {step} is unusable ({e}); falling back to step {steps[i + 1]} "
            f"(checkpoint_fallback=true; the bad step was moved to {aside})")
    return None, 0

  def _set_aside(self, step: int) -> str:
    aside = paths.join(self.directory, f"{step}.unusable-{int(time.time())}")
    if jax.process_index() == 0:
      if paths.is_url(self.directory):   # no rename there: the step is uncommitted (Orbax's
        paths.remove(paths.join(self.step_dir(step), COMMIT_MARKER))   # marker) before it moves
      paths.move_dir(self.step_dir(step), aside)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      multihost_utils.sync_global_devices(f"maxtext_set_aside_{step}")
    self._mngr.reload()
    return aside


def _check_files_in_background(step_dir: str, saved: dict, items: tuple[str, ...]
                               ) -> concurrent.futures.Future:
  """This process's share of the file checks (`manifest.verifier_of`), on a thread."""
  pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="verify_files")
  future = pool.submit(manifest.verify_files, step_dir, saved, items, jax.process_index(),
                       jax.process_count())
  pool.shutdown(wait=False)
  return future


def _file_problems(checking: concurrent.futures.Future | None) -> list[str]:
  """The problems this process found; every process learns how many the others found."""
  if checking is None:
    return []
  problems = checking.result()
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    counts = multihost_utils.process_allgather(np.int32(len(problems)))
    others = int(np.sum(counts)) - len(problems)
    if others:
      problems = problems + [f"{others} damaged files found by the other processes (see their "
                             "logs)"]
  return problems


def _read_manifest(step_dir: str, step: int, *, required: bool) -> dict | None:
  try:
    return manifest.read(step_dir)
  except (OSError, ValueError) as e:
    if not required:
      return None
    raise CheckpointError(
        f"checkpoint step {step} has no usable manifest ({_why(e)}); its integrity cannot be "
        "checked (checkpoint_verify=false restores it unchecked)") from e


def _unreadable_arrays(step_dir: str, abstract: dict) -> list[str]:
  """Restores each array alone to name the ones that cannot be read (the slow, failed path)."""
  bad = []
  for item, tree in abstract.items():
    item_dir = paths.join(step_dir, item)
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      single: dict = {}
      node = single
      if not all(isinstance(k, jax.tree_util.DictKey) for k in keypath):
        continue  # optimizer tuples: named through the whole-item error instead
      keys = [k.key for k in keypath]   # str, or int (the pattern stack's runs and members)
      for k in keys[:-1]:
        node = node.setdefault(k, {})
      node[keys[-1]] = leaf
      try:
        with ocp.PyTreeCheckpointer() as ckptr:
          ckptr.restore(item_dir, args=ocp.args.PyTreeRestore(
              item=single, partial_restore=True,
              restore_args=jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding),
                                        single)))
      except Exception as e:  # pylint: disable=broad-except
        bad.append(f"{item}/{'/'.join(map(str, keys))}: unreadable ({_why(e)})")
    if not bad and not paths.isfile(paths.join(item_dir, "_METADATA")):
      bad.append(f"{item}/_METADATA: missing")
  return bad


# ---- parameters only (fine-tuning, converters) -------------------------------------------------
def resolve_step_dir(path: str) -> str:
  """A run's `checkpoints/` directory (→ its latest committed step) or one step directory."""
  path = paths.absolute(path)
  if not paths.exists(path):
    raise FileNotFoundError(f"load_parameters_path '{path}' does not exist")
  if paths.isdir(paths.join(path, "params")):
    return path
  steps = ocp.utils.checkpoint_steps(path) if paths.isdir(path) else []
  if not steps:
    raise FileNotFoundError(f"load_parameters_path '{path}' holds no committed checkpoint")
  return paths.join(path, str(max(steps)))


def read_meta(path: str) -> dict:
  """The `meta` item ({"step", "config"}, and what its writer added: a LoRA run's `lora_base`, a
  conversion's `hf_source`) of a checkpoint (see `resolve_step_dir`)."""
  meta = paths.join(resolve_step_dir(path), "meta", "metadata")
  if not paths.isfile(meta):
    raise FileNotFoundError(f"checkpoint '{path}' has no meta/metadata (config) item")
  return json.loads(paths.read_bytes(meta))


HF_SOURCE = "hf_source"   # meta entry of a conversion: the Hugging Face folder it came from


def hf_source(path: str) -> str | None:
  """The Hugging Face folder the checkpoint at `path` was converted from (to_maxtext records it;
  a quantized conversion keeps it), or None: a training run wrote it."""
  return read_meta(path).get(HF_SOURCE)


def stored_param_names(path: str) -> set[str]:
  """The arrays a checkpoint's `params` item holds, as "/"-joined key paths (e.g.
  "decoder/runs/0/0/mlp/experts/wi"), from its metadata: no array is read."""
  handler = ocp.PyTreeCheckpointHandler()
  try:
    tree = handler.metadata(etils.epath.Path(paths.join(resolve_step_dir(path), "params"))).tree
  finally:
    handler.close()
  return {"/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in keypath)
          for keypath, _ in jax.tree_util.tree_flatten_with_path(tree)[0]}


def load_params(path: str, abstract_params: Any = None, *, verify: bool = True) -> Any:
  """Parameters only (fine-tuning), placed per `abstract_params`' shardings, which every leaf must
  carry; None gives host numpy arrays (converters: no devices, any mesh it was saved from).
  A checkpoint with a manifest is verified (unless `verify=False`)."""
  step_dir = resolve_step_dir(path)
  item_dir = paths.join(step_dir, "params")
  saved = _read_manifest(step_dir, -1, required=False) if verify else None
  if saved is not None:
    problems = _file_problems(_check_files_in_background(step_dir, saved,
                                                         ("params", tokenizer_files.ITEM)))
    if problems:
      raise CheckpointError(f"checkpoint '{step_dir}' is damaged: " + "; ".join(problems[:8]))
  if abstract_params is not None:
    require_target_shardings(abstract_params, f"parameters from '{step_dir}'")
    incompatible = manifest.check_compatible(saved, {"params": abstract_params}) if saved else []
    if incompatible:
      raise CheckpointError(f"parameters in '{step_dir}' do not fit this model: "
                            + "; ".join(incompatible[:8]))
  try:
    if abstract_params is None:
      # the item's handler directly (a Checkpointer would look for step-level metadata here)
      handler = ocp.PyTreeCheckpointHandler()
      try:
        item = etils.epath.Path(item_dir)
        as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray),
                                handler.metadata(item).tree)
        return handler.restore(item, args=ocp.args.PyTreeRestore(restore_args=as_numpy))
      finally:
        handler.close()
    with ocp.StandardCheckpointer() as ckptr:
      params = ckptr.restore(item_dir, abstract_params)
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointError(f"parameters in '{step_dir}' cannot be read: {_why(e)}") from e
  if saved is not None:
    differing = manifest.compare_arrays(saved, {"params": params})
    if differing:
      raise CheckpointError(f"checkpoint '{step_dir}' is damaged: " + "; ".join(differing[:8]))
  return params


def save_params_only(directory: str, params: Any, config: dict, step: int = 0,
                     tokenizer: dict[str, str] | None = None, meta: dict | None = None) -> None:
  """A checkpoint with just `params` and `meta` (what converters write: {"step", "config"} and the
  entries of `meta`, e.g. to_maxtext's `hf_source`) and, given {name: source file}, the
  tokenizer's files; committed atomically.
  Written uncompressed, from the arrays as they are, with Orbax's write window bounded by the
  largest array: compression would stage a compressed copy of everything in flight, and the
  converters' budget is about one copy of the weights. The result restores like any checkpoint."""
  _no_replica_slices_on_one_cpu_process()
  largest = max(int(a.size) * a.dtype.itemsize for a in jax.tree.leaves(params))
  window_gb = (max(largest, 64 * 10**6) + 2**20) / 10**9   # Orbax counts 10^9 bytes per "GB"
  options = ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False)
  handlers = {"params": ocp.PyTreeCheckpointHandler(save_concurrent_gb=window_gb,
                                                    use_compression=False),
              "meta": ocp.JsonCheckpointHandler(),
              tokenizer_files.ITEM: tokenizer_files.TokenizerFilesHandler()}
  args = {"params": ocp.args.PyTreeSave(params),
          "meta": ocp.args.JsonSave({**(meta or {}), "step": step, "config": config})}
  if tokenizer:
    args[tokenizer_files.ITEM] = tokenizer_files.TokenizerFilesSave(tokenizer)
  with ocp.CheckpointManager(paths.absolute(directory), options=options,
                             item_handlers=handlers) as mngr:
    mngr.save(step, args=ocp.args.Composite(**args))
    mngr.wait_until_finished()


def load_params_host(path: str, abstract_params: Any) -> Any:
  """Parameters as NumPy arrays (`load_params(path)`: straight into host memory, one copy) in
  exactly the structure of `abstract_params` (what converters and the logit check use). Orbax
  stores list indices as string keys ("0"); they are matched back to the model's integer keys, and
  every shape is checked."""
  restored = load_params(path)

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
