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
from MaxText.config.parallelism import fill_parallelism
from MaxText.config.schema import Config
from MaxText.backend.device_type import Device


# Appended to mesh errors on a CPU host (where the device count is whatever XLA was told).
CPU_DEVICES_HINT = ("on CPU, fake devices: XLA_FLAGS=--xla_force_host_platform_device_count=N "
                    "(set before Python starts) gives N CPU devices")


def num_slices(devices: Sequence[Device]) -> int:
  return 1 + max(getattr(d, "slice_index", 0) or 0 for d in devices)


def mesh_shape(cfg: Config, devices: Sequence[Device]) -> tuple[list[int], list[int]]:
  """Resolved (ici, dcn) sizes per axis of `cfg.mesh_axes`."""
  slices = num_slices(devices)
  if len(devices) % slices:
    raise ConfigError(f"{len(devices)} devices do not split evenly into {slices} slices")
  try:
    ici = fill_parallelism(cfg.ici_parallelism(), len(devices) // slices, "ici", cfg.mesh_axes)
    dcn = fill_parallelism(cfg.dcn_parallelism(), slices, "dcn", cfg.mesh_axes)
  except ConfigError as e:
    if devices[0].platform != "cpu":
      raise
    raise ConfigError(f"{e} ({len(devices)} {devices[0].platform} devices; {CPU_DEVICES_HINT})"
                      ) from None
  return ici, dcn


def device_grid(cfg: Config, devices: Sequence[Device]) -> np.ndarray:
  """The devices arranged as an array of shape ici × dcn per mesh axis (dcn outermost)."""
  ici, dcn = mesh_shape(cfg, devices)
  if math.prod(dcn) > 1:
    return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices)
  if devices[0].platform in ("tpu", "gpu", "cuda", "rocm"):
    return mesh_utils.create_device_mesh(ici, devices)
  return np.asarray(devices).reshape(ici)  # CPU: no topology to optimise; keep the device order


def create_mesh(cfg: Config, devices: Sequence[Device] | None = None) -> Mesh:
  grid = device_grid(cfg, list(jax.devices() if devices is None else devices))
  return Mesh(grid, tuple(cfg.mesh_axes), axis_types=(AxisType.Auto,) * len(cfg.mesh_axes))
