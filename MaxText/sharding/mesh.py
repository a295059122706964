"""Device mesh from the `ici_*` / `dcn_*` parallelism keys.

`ici_<axis>_parallelism` splits the devices of one slice (fast interconnect), `dcn_<axis>_parallelism`
splits the slices (data-centre network). At most one value per level may be -1, meaning "whatever is
left". With more than one slice the mesh is a hybrid mesh: each mesh axis has size ici × dcn, and the
dcn part is outermost so that only that part of a collective crosses slices.
"""
from __future__ import annotations

import math
from typing import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from MaxText.config.load import ConfigError
from MaxText.config.schema import Config


def fill_parallelism(values: Sequence[int], total: int, level: str, axes: Sequence[str]) -> list[int]:
  """Replaces the single -1 in `values` so that the product equals `total`."""
  values = list(values)
  for axis, v in zip(axes, values):
    if v == 0 or v < -1:
      raise ConfigError(f"{level}_{axis}_parallelism={v}: must be a positive size or -1")
  holes = [i for i, v in enumerate(values) if v == -1]
  if len(holes) > 1:
    names = ", ".join(f"{level}_{axes[i]}_parallelism" for i in holes)
    raise ConfigError(f"at most one {level} parallelism may be -1, got -1 for {names}")
  known = math.prod(v for v in values if v != -1)
  if holes:
    if total % known:
      raise ConfigError(f"{level} parallelism: the fixed sizes multiply to {known}, which does not "
                        f"divide the {total} {'devices per slice' if level == 'ici' else 'slices'}")
    values[holes[0]] = total // known
  if math.prod(values) != total:
    detail = " x ".join(f"{level}_{a}_parallelism={v}" for a, v in zip(axes, values))
    raise ConfigError(f"{level} mesh {detail} = {math.prod(values)}, but there are {total} "
                      f"{'devices per slice' if level == 'ici' else 'slices'}")
  return values


def num_slices(devices: Sequence[jax.Device]) -> int:
  return 1 + max(getattr(d, "slice_index", 0) or 0 for d in devices)


def mesh_shape(cfg: Config, devices: Sequence[jax.Device]) -> tuple[list[int], list[int]]:
  """Resolved (ici, dcn) sizes per axis of `cfg.mesh_axes`."""
  slices = num_slices(devices)
  if len(devices) % slices:
    raise ConfigError(f"{len(devices)} devices do not split evenly into {slices} slices")
  ici = fill_parallelism(cfg.ici_parallelism(), len(devices) // slices, "ici", cfg.mesh_axes)
  dcn = fill_parallelism(cfg.dcn_parallelism(), slices, "dcn", cfg.mesh_axes)
  return ici, dcn


def device_grid(cfg: Config, devices: Sequence[jax.Device]) -> np.ndarray:
  """The devices arranged as an array of shape ici × dcn per mesh axis (dcn outermost)."""
  ici, dcn = mesh_shape(cfg, devices)
  if math.prod(dcn) > 1:
    return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices)
  if devices[0].platform in ("tpu", "gpu", "cuda", "rocm"):
    return mesh_utils.create_device_mesh(ici, devices)
  return np.asarray(devices).reshape(ici)  # CPU: no topology to optimise; keep the device order


def create_mesh(cfg: Config, devices: Sequence[jax.Device] | None = None) -> Mesh:
  grid = device_grid(cfg, list(jax.devices() if devices is None else devices))
  return Mesh(grid, tuple(cfg.mesh_axes), axis_types=(AxisType.Auto,) * len(cfg.mesh_axes))
