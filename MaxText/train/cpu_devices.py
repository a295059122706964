"""The default number of XLA:CPU devices: one per usable core (at most MAX_DEFAULT), when the user
chose nothing.

One XLA:CPU device runs a transformer step as a mostly sequential chain of ops; independent ops and
the YNNPACK matmuls spread over the cores, but not all the time. Splitting the global batch over one
fake device per core keeps every core busy (benchmarks/RESULTS.md: the measured difference), so a
plain `train.py configs/base.yml` on a CPU host uses the whole machine. Applied only to a
single-process run whose user set none of: `--xla_force_host_platform_device_count` in XLA_FLAGS,
JAX_NUM_CPU_DEVICES, JAX_PLATFORMS (or the same through jax.config); and only before JAX starts its
backends. It changes nothing on a GPU/TPU host (only the CPU backend's device count). Note that
`per_device_batch_size` is per device: the global batch grows with the device count.
"""
from __future__ import annotations

import os
from typing import Mapping

import jax

# Beyond this many devices each one's batch and the collectives grow while one device's intra-op
# threads already use the cores; more can always be asked for with the flags above.
MAX_DEFAULT = 8
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def usable_cores() -> int:
  try:
    return len(os.sched_getaffinity(0))   # honours taskset / cgroup cpusets
  except AttributeError:                  # not on Linux
    return os.cpu_count() or 1


def user_choice(env: Mapping[str, str], num_cpu_devices: int | None = None,
                platforms: str | None = None) -> str:
  """What the user set that decides the CPU devices or the platform ("" = nothing).
  `num_cpu_devices` / `platforms`: jax.config's values (read from it when not given)."""
  if DEVICE_COUNT_FLAG in env.get("XLA_FLAGS", ""):
    return f"XLA_FLAGS {DEVICE_COUNT_FLAG}"
  for name in ("JAX_NUM_CPU_DEVICES", "JAX_PLATFORMS", "JAX_PLATFORM_NAME"):
    if env.get(name, "").strip():
      return name
  if num_cpu_devices is None:
    num_cpu_devices, platforms = jax.config.jax_num_cpu_devices, jax.config.jax_platforms
  if num_cpu_devices not in (-1, None):
    return "jax_num_cpu_devices"
  if platforms:
    return "jax_platforms"
  return ""


def _backends_started() -> bool:
  from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
  return xla_bridge.backends_are_initialized()


def apply_default(env: Mapping[str, str] | None = None) -> int | None:
  """Sets one CPU device per usable core (at most MAX_DEFAULT) if the user chose nothing and the
  backends have not started; returns the count set, or None."""
  env = os.environ if env is None else env
  if user_choice(env) or _backends_started():
    return None
  count = max(1, min(usable_cores(), MAX_DEFAULT))
  jax.config.update("jax_num_cpu_devices", count)
  return count


def describe(count: int | None, platform: str) -> str:
  """The note printed with the mesh about where the CPU device count came from."""
  if count is None or platform != "cpu":
    return ""
  return (f" (one per core of {usable_cores()}, chosen by default; set "
          f"XLA_FLAGS={DEVICE_COUNT_FLAG}=N or JAX_NUM_CPU_DEVICES=N to choose)")
