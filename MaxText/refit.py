"""Refit: the trainer's current parameters as (Hugging Face name, tensor) pairs, one at a time — what
an inference engine (vLLM's `model.load_weights(weights: Iterable[tuple[str, Tensor]])`) or a
transformers model (`load_state_dict`) takes.

    for name, tensor in refit.stream(params, cfg):    # params: sharded jax.Arrays, any mesh
      ...

The names and layouts are the family's own Hugging Face map (`FAMILY.hf_maps`, the one
`to_huggingface` writes with: MaxText/models/name_map.py), so nothing here knows a family:
  - `layout="checkpoint"` (default): the hub's files as `save_pretrained` writes them, what vLLM's
    loaders read (Qwen3-MoE experts one tensor per expert; Gemma 4's experts fused, as its hub
    files are);
  - `layout="state_dict"`: transformers' in-memory `state_dict()` names (experts fused where the
    architecture's map has a fused form, the tied head included), for `load_state_dict(strict=True)`.
A LoRA model (`lora_rank > 0`) is streamed merged, W + alpha/r A B, block by block
(`lora.merge_kernel`: the same numbers as the merged export).

Several processes (a multi-host run, a group of Ray workers): every process streams the same
tensors in the same order, each block gathered from all of them. Memory: the name map indexes each
parameter where it lives before anything is copied, so a
scanned stack [L, ...] gives one layer's block (gathered from its shards), never the stack; the
caller holds one tensor at a time (the generator keeps no reference to what it yielded). On the
host (`tensors="numpy"`, the CPU default) each tensor is a NumPy array; `tensors="torch"` gives
torch tensors: on a GPU/TPU platform the block and its layout change stay on the devices, are put
on one device and handed over with DLPack (no host copy), on CPU `torch.from_numpy`.

The other end, for an engine of ours (rollout_placement=separate, a Ray engine actor):
`Receiver(mcfg, engine_shardings, model_type).load(stream(...), previous)` writes each tensor into
its parameter on the engine's devices as it arrives (each device its slice), so neither end puts
the model together on one host.

The command line lists what an engine would receive from a checkpoint (a LoRA one merged):
  python -m MaxText.refit load_parameters_path=runs/sft/checkpoints [layout=state_dict]
prints one `name shape dtype` line per tensor, then their count and bytes.
"""
from __future__ import annotations

import sys

from MaxText.config import cli
from MaxText.config.load import ConfigError

ARGS = {
    "layout": cli.Arg(str, "checkpoint", "checkpoint (the hub's files, vLLM) | state_dict "
                      "(transformers' load_state_dict)"),
}

if __name__ == "__main__":   # --help and a bad argument: answered before jax is imported
  cli.answer_early(sys.argv[1:], ARGS, __doc__, tool="refit",
                   bad_input=(ConfigError, ValueError, KeyError, FileNotFoundError))

import dataclasses
import functools
import inspect
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from jax.sharding import NamedSharding, PartitionSpec

from MaxText.config.schema import Config
from MaxText.layers import lora
from MaxText.models.model_config import ModelConfig
from MaxText.models.name_map import block_shape, split_path, to_ours
from MaxText.models.registry import check_model, get_hf_map, hf_model_type_for
from MaxText.runtime.exit_codes import reported

LAYOUTS = ("checkpoint", "state_dict")
TENSORS = ("numpy", "torch")


@jax.jit
def _take(x: jax.Array, ints: jax.Array) -> jax.Array:
  return x[tuple(ints)]


class _Param:
  """One parameter as the name map reads it (`shape`, `ndim`, `dtype`, `[index]`): a block is
  indexed where the array lives (on CPU devices: read out of the shards), then brought to the
  host (NumPy) unless `on_device`; an adapted
  kernel's block is merged with its adapters' blocks."""

  def __init__(self, w: Any, on_device: bool, adapters: tuple[Any, Any] | None = None,
               scale: float = 0.0):
    self._w, self._on_device, self._adapters, self._scale = w, on_device, adapters, scale
    self.shape, self.ndim, self.dtype = tuple(w.shape), len(w.shape), w.dtype

  def _block(self, x: Any, ints: tuple) -> Any:
    """x[ints] (leading integer indices: a layer, an expert) where x lives, then here."""
    if ints and isinstance(x, jax.Array) and _in_host_memory(x):
      return _cpu_block(x, ints)                   # read out of the shards: no program
    if ints and isinstance(x, jax.Array):
      x = _take(x, np.asarray(ints, np.int32))     # one compiled program per shape, not per index
    elif ints:
      x = x[ints]
    return x if self._on_device else _host(x)

  def __getitem__(self, index: Any) -> Any:
    index = index if isinstance(index, tuple) else (index,)
    if self._adapters is None:
      n = next((j for j, i in enumerate(index) if not isinstance(i, (int, np.integer))),
               len(index))
      return self._block(self._w, index[:n])[index[n:]]
    a, b = self._adapters
    lead = a.ndim + b.ndim - self.ndim - 2          # the stacked axes ("layers") in front
    w, a, b = (self._block(x, index[:lead]) for x in (self._w, a, b))
    return lora.merge_kernel(w, a, b, self._scale)[index[lead:]]

  def __array__(self, dtype=None, copy=None):      # the whole parameter (the name map's checks)
    del copy
    out = _host(self._w)
    return out if dtype is None else out.astype(dtype)


def _in_host_memory(x: jax.Array) -> bool:
  """Whether all of `x` is in this process's CPU devices (host memory: its shards read as NumPy
  views without a copy)."""
  return x.is_fully_addressable and all(d.platform == "cpu" for d in x.devices())


def _cpu_block(x: jax.Array, ints: tuple) -> np.ndarray:
  """x[ints] (leading integer indices) of a CPU array, put together from the shards that hold it
  (one copy of each replicated piece): no compiled program per shape and sharding, and no more
  than the block is copied."""
  ints = tuple(int(i) % n for i, n in zip(ints, x.shape))
  out = np.empty(x.shape[len(ints):], x.dtype)
  for shard in x.addressable_shards:
    lead, rest = shard.index[:len(ints)], shard.index[len(ints):]
    starts = [s.indices(n)[0] for s, n in zip(lead, x.shape)]
    stops = [s.indices(n)[1] for s, n in zip(lead, x.shape)]
    if shard.replica_id == 0 and all(a <= i < b for i, a, b in zip(ints, starts, stops)):
      out[rest] = np.asarray(shard.data)[tuple(i - a for i, a in zip(ints, starts))]
  return out


def _host(x: Any) -> np.ndarray:
  """`x` whole on this host; a global array of several processes is gathered (a collective: every
  process streams the same tensors in the same order)."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


def _views(params: Any, scale: float, on_device: bool) -> dict:
  """The parameter tree without adapters, each leaf a `_Param` (adapted kernels merged)."""
  flat = traverse_util.flatten_dict(params)
  out = {}
  for k, v in flat.items():
    if lora.is_adapter(k):
      continue
    adapters = (flat[(*k[:-1], "lora_a")], flat[(*k[:-1], "lora_b")]) \
        if k[-1] == "kernel" and (*k[:-1], "lora_a") in flat else None
    out[k] = _Param(v, on_device, adapters, scale)
  return traverse_util.unflatten_dict(out)


def _on_accelerator(params: Any) -> bool:
  leaves = jax.tree.leaves(params)
  return bool(leaves) and isinstance(leaves[0], jax.Array) and \
      next(iter(leaves[0].devices())).platform != "cpu"


def _own(x: Any) -> np.ndarray:
  """A host array of its own: a read-only one may be a view of a jax buffer (a CPU parameter the
  next train step donates), so it is copied."""
  x = np.asarray(x)
  return x if x.flags.writeable else x.copy()


def _to_torch(x: Any, device: Any) -> Any:
  import torch  # pylint: disable=import-outside-toplevel
  if isinstance(x, np.ndarray):
    return torch.from_numpy(_own(np.asarray(x, order="C")))   # (0-d stays 0-d)
  # one device's copy of the block, handed over without leaving the accelerator
  from torch.utils.dlpack import from_dlpack  # pylint: disable=import-outside-toplevel
  return from_dlpack(jax.device_put(x, device))


def stream(params: Any, cfg: Config, *, layout: str = "checkpoint", tensors: str = "numpy",
           hf_model_type: str = "") -> Iterator[tuple[str, Any]]:
  """(Hugging Face name, tensor) of every tensor of the model of `cfg` with `params` (a pure-dict
  tree as the trainer holds it: jax.Arrays sharded on any mesh, or host arrays), one at a time.
  ValueError when the model has no Hugging Face architecture or `layout` / `tensors` is unknown."""
  if layout not in LAYOUTS:
    raise ValueError(f"layout={layout!r}: one of {', '.join(LAYOUTS)}")
  if tensors not in TENSORS:
    raise ValueError(f"tensors={tensors!r}: one of {', '.join(TENSORS)}")
  mcfg = ModelConfig.from_config(cfg)
  model_type = hf_model_type_for(mcfg, cfg.hf_model_type or hf_model_type)
  for key, problem in check_model(mcfg, model_type):
    raise ValueError(f"{key}: {problem}")
  hf_map = get_hf_map(model_type)
  base = dataclasses.replace(mcfg, lora_rank=0)
  scale = cfg.lora_alpha / cfg.lora_rank if cfg.lora_rank else 0.0
  on_device = tensors == "torch" and _on_accelerator(params)
  kw: dict[str, Any] = {"on_device": on_device}
  if layout == "state_dict":
    kw["tied_lm_head"] = True
    if "fused" in inspect.signature(hf_map.params_to_hf).parameters:   # maps with both forms
      kw["fused"] = True
  lazy = hf_map.params_to_hf(_views(params, scale, on_device), base, **kw)
  device = jax.local_devices()[0] if on_device else None
  for name in lazy:
    tensor = lazy[name]
    yield name, (_to_torch(tensor, device) if tensors == "torch" else _own(tensor))


def stream_map(model_type: str) -> Any:
  """The `NameMap` the checkpoint layout of `stream` is written with, when the family's map
  module streams through one (its `params_to_hf` is the map's, or it names it `CHECKPOINT_MAP`);
  else None (a map with its own layout changes: `Receiver` then refuses)."""
  hf_map = get_hf_map(model_type)
  nm = getattr(hf_map, "CHECKPOINT_MAP", None)
  if nm is not None:
    return nm
  nm = getattr(hf_map, "NAME_MAP", None)
  return nm if nm is not None and getattr(hf_map, "params_to_hf", None) == nm.params_to_hf \
      else None


@functools.partial(jax.jit, donate_argnums=(0,))
def _put(param: jax.Array, block: jax.Array, start: jax.Array) -> jax.Array:
  """param with `block` (its trailing axes) written at `start`, in place (donated)."""
  block = jnp.expand_dims(block, tuple(range(param.ndim - block.ndim)))
  return jax.lax.dynamic_update_slice(param, block, tuple(start))


class Receiver:
  """The other end of `stream` (layout "checkpoint"): an inference engine of ours that loads the
  stream's tensors into its own parameters, one tensor at a time. Each tensor is turned into the
  block of our parameter it is (the name map's rule read backwards), put on the engine's devices
  with the parameter's sharding (each device gets only its slice) and written into the
  parameter there — nothing of the model is gathered on the host beyond the one tensor in hand.

      receiver = Receiver(mcfg, engine_shardings, model_type)
      params = receiver.load(refit.stream(trainer_params, cfg))            # the first time
      params = receiver.load(refit.stream(trainer_params, cfg), params)    # in place after that

  `mcfg`: the engine's model (`lora_rank=0`: the stream's weights are merged). ValueError when the
  family's map cannot be read backwards tensor by tensor, a tensor is unknown, has the wrong shape,
  or the stream ends with a parameter not filled."""

  def __init__(self, mcfg: ModelConfig, shardings: Any, model_type: str):
    nm = stream_map(model_type)
    if nm is None:
      raise ValueError(f"hf_model_type={model_type}: its Hugging Face map changes layouts of its "
                       f"own, so the refit stream cannot be loaded tensor by tensor")
    self.mcfg = mcfg
    self.shardings: dict[tuple, Any] = traverse_util.flatten_dict(shardings)
    specs = nm.specs(mcfg)
    self.targets: dict[str, tuple[tuple, Any, tuple, Any]] = {}
    for e in nm.plan(mcfg, specs):
      for name, index in e.sources:
        self.targets[name] = (e.path, e.rule, index, e.spec)
    self.specs = specs
    # our parameters HF has no counterpart of (a MoE selection bias): zeros, as on import
    self.zeros = [p for p in map(split_path, nm.ours_only) if p in specs]
    self._flat: dict[tuple, Any] = {}
    self._seen: set[str] = set()

  def _block_sharding(self, path: tuple, shape: tuple[int, ...], skip: int) -> Any:
    """The parameter's sharding for a block without its first `skip` axes (an axis the block
    does not divide evenly: replicated)."""
    sharding = self.shardings[path]
    spec = tuple(sharding.spec) + (None,) * (len(self.specs[path].shape) - len(sharding.spec))
    sizes = dict(zip(sharding.mesh.axis_names, sharding.mesh.devices.shape))
    out = []
    for dim, axes in zip(shape, spec[skip:]):
      names = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
      out.append(axes if dim % max(1, int(np.prod([sizes[a] for a in names]))) == 0 else None)
    return NamedSharding(sharding.mesh, PartitionSpec(*out))

  def load(self, tensors: Iterator[tuple[str, Any]], into: Any = None) -> Any:
    """The parameters (on the engine's shardings) of the streamed `tensors`; `into`: parameters
    this receiver returned before, overwritten in place (donated)."""
    self.begin(into)
    for name, tensor in tensors:
      self.put(name, tensor)
      del tensor
    return self.finish()

  # the same, one call per tensor (an engine that is sent the tensors: a Ray actor)
  def begin(self, into: Any = None) -> None:
    self._flat = dict(traverse_util.flatten_dict(into)) if into is not None else {}
    self._seen = set()

  def put(self, name: str, tensor: Any) -> None:
    """Writes one streamed tensor into its parameter on the engine's devices."""
    if name not in self.targets:
      raise ValueError(f"refit: {name} has no place in the engine's model")
    flat = self._flat
    path, rule, index, spec = self.targets[name]
    ints = tuple(i for i in index if isinstance(i, (int, np.integer)))
    host = to_ours(np.asarray(tensor), block_shape(spec.shape, index), rule, name)
    del tensor
    start = [*ints] + [0] * (len(spec.shape) - len(ints))
    if index and isinstance(index[-1], slice):      # part j of the last axis
      start[-1] = index[-1].start
    block = jax.device_put(host.astype(spec.dtype, copy=False),
                           self._block_sharding(path, host.shape, len(ints)))
    del host
    if path not in flat:
      flat[path] = self._zeros(path)
    flat[path] = _put(flat[path], block, np.asarray(start, np.int32))
    self._seen.add(name)

  def finish(self) -> Any:
    """The parameters, once every tensor was put (ValueError naming those that were not)."""
    flat = self._flat
    missing = sorted(set(self.targets) - self._seen)
    if missing:
      raise ValueError(f"refit: the stream ended without {missing[:3]}"
                       f"{f' and {len(missing) - 3} more' if len(missing) > 3 else ''}")
    for path in self.zeros:
      if path not in flat:
        flat[path] = self._zeros(path)
    self._flat = {}
    return traverse_util.unflatten_dict(flat)

  def _zeros(self, path: tuple) -> jax.Array:
    spec = self.specs[path]
    return jnp.zeros(spec.shape, spec.dtype, device=self.shardings[path])


def main(argv: list[str]) -> int:
  from MaxText.checkpoint_conversion.to_huggingface import (  # pylint: disable=import-outside-toplevel
      checkpoint_config, float_config, host_params)
  def run() -> int:
    parsed = cli.parse(argv, ARGS, __doc__, tool="refit")
    if parsed is None:
      return 0
    args, given, _ = parsed
    ckpt = cli.require(given, "load_parameters_path", "the checkpoint (a run's checkpoints/, a "
                       "step, a to_maxtext output)")
    saved = checkpoint_config(ckpt)
    params = host_params(ckpt, saved)   # LoRA base joined, dequantized
    cfg = float_config(saved)
    count = nbytes = 0
    for name, tensor in stream(params, cfg, layout=args["layout"]):
      print(f"{name} {tuple(tensor.shape)} {tensor.dtype}")
      count, nbytes = count + 1, nbytes + tensor.nbytes
    print(f"{count} tensors, {nbytes / 2**20:.2f} MiB")
    return 0
  return reported(run, (ConfigError, ValueError, KeyError, FileNotFoundError))

if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
