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

The command line lists what an engine would receive from a checkpoint (a LoRA one merged):
  python -m MaxText.refit load_parameters_path=runs/sft/checkpoints [layout=state_dict]
prints one `name shape dtype` line per tensor, then their count and bytes.
"""
from __future__ import annotations

import dataclasses
import inspect
import sys
from typing import Any, Iterator

import jax
import numpy as np
from flax import traverse_util

from MaxText.config import cli
from MaxText.config.load import ConfigError
from MaxText.config.schema import Config
from MaxText.layers import lora
from MaxText.models.model_config import ModelConfig
from MaxText.models.registry import check_model, get_hf_map, hf_model_type_for
from MaxText.runtime.exit_codes import reported

LAYOUTS = ("checkpoint", "state_dict")
TENSORS = ("numpy", "torch")


@jax.jit
def _take(x: jax.Array, ints: jax.Array) -> jax.Array:
  return x[tuple(ints)]


class _Param:
  """One parameter as the name map reads it (`shape`, `ndim`, `dtype`, `[index]`): a block is
  indexed where the array lives, then brought to the host (NumPy) unless `on_device`; an adapted
  kernel's block is merged with its adapters' blocks."""

  def __init__(self, w: Any, on_device: bool, adapters: tuple[Any, Any] | None = None,
               scale: float = 0.0):
    self._w, self._on_device, self._adapters, self._scale = w, on_device, adapters, scale
    self.shape, self.ndim, self.dtype = tuple(w.shape), len(w.shape), w.dtype

  def _block(self, x: Any, ints: tuple) -> Any:
    """x[ints] (leading integer indices: a layer, an expert) where x lives, then here."""
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
  return torch.utils.dlpack.from_dlpack(jax.device_put(x, device))


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


ARGS = {
    "layout": cli.Arg(str, "checkpoint", "checkpoint (the hub's files, vLLM) | state_dict "
                      "(transformers' load_state_dict)"),
}


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
