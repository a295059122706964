"""LoRA adapters ↔ a PEFT adapter folder (`adapter_config.json` + `adapter_model.safetensors`,
what `peft.PeftModel.from_pretrained(base, folder)` loads onto the transformers base model).

Where each adapter goes is learned from the family's own name map, not from a table here: the
map's `params_to_hf` is run on index arrays in place of the adapted kernels (read-only broadcast
views, one HF tensor made at a time), which says for every HF tensor the kernel and stacked layer
it comes from and which of our input / output positions each of its columns / rows holds. Our
kernel [*lead, *in, *out] = A [*lead, *in, r] @ B [*lead, r, *out] per stacked index, and HF's
`nn.Linear.weight` [out, in] is a reordering of it, so PEFT's factors are our A's rows and B's
columns in HF's order: lora_A.weight [r, in] = A[cols].T, lora_B.weight [out, r] = B[:, rows].T,
with the same scale alpha / r. An HF tensor fed by two kernels, or mixing input and output
positions, cannot hold a factorised update and is refused.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
from flax import traverse_util

from MaxText.checkpoint_conversion.hf_io import HFFolderError

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."


@dataclass(frozen=True)
class Place:
  kernel: tuple            # our kernel's path
  lead: tuple              # index on its stacked leading axes
  cols: np.ndarray         # HF column j holds our (flattened) input position cols[j]
  rows: np.ndarray         # HF row i holds our (flattened) output position rows[i]


def _ranks(kernel_shape, a_shape, b_shape) -> tuple[int, int]:
  lead = len(a_shape) + len(b_shape) - len(kernel_shape) - 2   # a [*lead, *in, r], b [*lead, r, *out]
  return lead, len(a_shape) - 1 - lead


def places(hf_map: Any, mcfg_base: Any, shapes: Mapping[tuple, Any]) -> dict[str, Place]:
  """HF tensor name → Place, for every HF tensor an adapted kernel feeds. `shapes`: our flat
  parameter shapes with the adapters (path → ShapeDtypeStruct or array)."""
  adapted = sorted(k[:-1] for k in shapes if k[-1] == "lora_a")
  base = {k: tuple(v.shape) for k, v in shapes.items() if k[-1] not in ("lora_a", "lora_b")}
  views = {"where": {}, "in": {}, "out": {}}
  zero = np.zeros((), np.int64)
  for k, shape in base.items():
    for v in views.values():
      v[k] = np.broadcast_to(zero, shape)
  lead_max = max(math.prod(base[(*m, "kernel")][:_ranks(base[(*m, "kernel")],
                                                         shapes[(*m, "lora_a")].shape,
                                                         shapes[(*m, "lora_b")].shape)[0]])
                 for m in adapted) if adapted else 1
  for mid, m in enumerate(adapted):
    kshape = base[(*m, "kernel")]
    lead, n_in = _ranks(kshape, shapes[(*m, "lora_a")].shape, shapes[(*m, "lora_b")].shape)
    lshape, ishape, oshape = kshape[:lead], kshape[lead:lead + n_in], kshape[lead + n_in:]
    n = len(kshape)
    grid = lambda sizes, at, n=n: np.arange(1, math.prod(sizes) + 1, dtype=np.int64).reshape(
        (1,) * at + tuple(sizes) + (1,) * (n - at - len(sizes)))
    views["where"][(*m, "kernel")] = np.broadcast_to(
        1 + mid * lead_max + grid(lshape, 0) - 1, kshape)
    views["in"][(*m, "kernel")] = np.broadcast_to(grid(ishape, lead), kshape)
    views["out"][(*m, "kernel")] = np.broadcast_to(grid(oshape, lead + n_in), kshape)
  hf = {n: hf_map.params_to_hf(traverse_util.unflatten_dict(v), mcfg_base)
        for n, v in views.items()}
  out = {}
  for name in hf["where"]:
    where = np.asarray(hf["where"][name])
    if not where.any():
      continue
    w0 = int(where.flat[0])
    cols, rows = np.asarray(hf["in"][name]), np.asarray(hf["out"][name])
    if where.ndim != 2 or (where != w0).any() or (cols != cols[:1]).any() \
        or (rows != rows[:, :1]).any() or not cols.all() or not rows.all():
      raise ValueError(f"{name}: the Hugging Face tensor does not hold one adapted kernel's "
                       "input x output positions, so a LoRA update cannot be written for it")
    m = adapted[(w0 - 1) // lead_max]
    kshape = base[(*m, "kernel")]
    lead, _ = _ranks(kshape, shapes[(*m, "lora_a")].shape, shapes[(*m, "lora_b")].shape)
    lead_index = np.unravel_index((w0 - 1) % lead_max, kshape[:lead]) if lead else ()
    out[name] = Place(m, tuple(int(i) for i in lead_index), cols[0] - 1, rows[:, 0] - 1)
  return out


def _module(name: str) -> str:
  if not name.endswith(".weight"):
    raise ValueError(f"{name}: an adapted Hugging Face tensor must be a Linear's .weight")
  return name[:-len(".weight")]


def export_peft(folder: str, params: Mapping, hf_map: Any, mcfg_base: Any, *, rank: int,
                alpha: float, base_model: str = "") -> list[str]:
  """Writes the PEFT folder of the adapters in `params` (host arrays); returns the modules."""
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  flat = traverse_util.flatten_dict(params)
  tensors = {}
  for name, p in places(hf_map, mcfg_base, flat).items():
    a, b = (np.asarray(flat[(*p.kernel, n)], np.float32)[p.lead] for n in ("lora_a", "lora_b"))
    module = PREFIX + _module(name)
    tensors[module + ".lora_A.weight"] = np.ascontiguousarray(a.reshape(-1, rank)[p.cols].T)
    tensors[module + ".lora_B.weight"] = np.ascontiguousarray(b.reshape(rank, -1)[:, p.rows].T)
  modules = sorted({k[len(PREFIX):-len(".lora_A.weight")] for k in tensors if "lora_A" in k})
  os.makedirs(folder, exist_ok=True)
  save_file(tensors, os.path.join(folder, WEIGHTS), metadata={"format": "pt"})
  config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
            "target_modules": modules, "lora_dropout": 0.0, "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
            "init_lora_weights": True, "modules_to_save": None,
            "base_model_name_or_path": base_model, "inference_mode": True}
  with open(os.path.join(folder, CONFIG), "w", encoding="utf-8") as f:
    json.dump(config, f, indent=2)
  return modules


def read_peft_config(folder: str) -> dict:
  """adapter_config.json, refusing what our adapters cannot hold (HFFolderError)."""
  path = os.path.join(folder, CONFIG)
  try:
    with open(path, encoding="utf-8") as f:
      config = json.load(f)
  except (OSError, ValueError) as e:
    raise HFFolderError(f"{path} cannot be read: {e}") from e
  refusals = {"peft_type": ("LORA",), "use_rslora": (False, None), "use_dora": (False, None),
              "bias": ("none", None), "modules_to_save": (None, []), "fan_in_fan_out": (False, None),
              "rank_pattern": ({}, None), "alpha_pattern": ({}, None)}
  for key, allowed in refusals.items():
    if config.get(key) not in allowed:
      raise HFFolderError(f"{path}: {key}={config.get(key)!r} is not supported (only "
                          f"{allowed[0]!r})")
  if not isinstance(config.get("r"), int) or config["r"] < 1:
    raise HFFolderError(f"{path}: r={config.get('r')!r} must be a positive integer")
  return config


def adapted_modules(folder: str) -> list[str]:
  """The HF module names a PEFT folder's weights adapt (without PEFT's prefix)."""
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  path = os.path.join(folder, WEIGHTS)
  try:
    with safe_open(path, "np") as f:
      names = list(f.keys())
  except (OSError, ValueError) as e:
    raise HFFolderError(f"{path} cannot be read: {e}") from e
  modules = set()
  for n in names:
    m = re.fullmatch(r"(.*)\.lora_[AB]\.weight", n)
    if m is None:
      raise HFFolderError(f"{path}: {n} is not a LoRA factor (.lora_A.weight / .lora_B.weight)")
    module = m.group(1)
    modules.add(module[len(PREFIX):] if module.startswith(PREFIX) else module)
  return sorted(modules)


def import_peft(folder: str, params: dict, hf_map: Any, mcfg_base: Any, *, rank: int) -> dict:
  """`params` (host arrays, adapters present) with the PEFT folder's factors written into the
  adapters (those PEFT does not adapt stay zero: no update)."""
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  flat: dict[tuple, Any] = {k: (np.zeros_like(v) if k[-1] in ("lora_a", "lora_b") else v)
          for k, v in traverse_util.flatten_dict(params).items()}
  where = {_module(n): p for n, p in places(hf_map, mcfg_base, flat).items()}
  path = os.path.join(folder, WEIGHTS)
  with safe_open(path, "np") as f:
    names = set(f.keys())
    for ours in adapted_modules(folder):
      if ours not in where:
        raise HFFolderError(f"{path}: {ours} is not a projection our adapters cover")
      p = where[ours]
      module = PREFIX + ours if f"{PREFIX}{ours}.lora_A.weight" in names else ours
      a_hf, b_hf = (f.get_tensor(n) for n in (f"{module}.lora_A.weight",
                                              f"{module}.lora_B.weight"))
      if a_hf.shape[0] != rank or b_hf.shape[1] != rank:
        raise HFFolderError(f"{path}: {module} has rank {a_hf.shape[0]}, the config says {rank}")
      a, b = flat[(*p.kernel, "lora_a")], flat[(*p.kernel, "lora_b")]
      a_view = a[p.lead].reshape(-1, rank)  # pyright: ignore[reportIndexIssue] (numpy leaves)
      b_view = b[p.lead].reshape(rank, -1)  # pyright: ignore[reportIndexIssue]
      a_view[p.cols] = a_hf.T.astype(a.dtype)
      b_view[:, p.rows] = b_hf.T.astype(b.dtype)
  return traverse_util.unflatten_dict(flat)

