"""The default number of XLA:CPU devices: one per usable core (at most MAX_DEFAULT), when the user
chose nothing.

One XLA:CPU device runs a transformer step as a mostly sequential chain of ops; independent ops and
the YNNPACK matmuls spread over the cores, but not all the time. Splitting the global batch over one
fake device per core keeps every core busy (benchmarks/RESULTS.md, the default run), so a
plain `train.py configs/base.yml` on a CPU host uses the whole machine. Applied only to a
single-process run whose user set none of: `--xla_force_host_platform_device_count` in XLA_FLAGS,
JAX_NUM_CPU_DEVICES, JAX_PLATFORMS (or the same through jax.config); and only before JAX starts its
backends. It changes nothing on a GPU/TPU host (only the CPU backend's device count). Note that
`per_device_batch_size` is per device: the global batch grows with the device count.

XLA:CPU's threads, for the record (read in XLA's CPU client and counted in /proc): the intra-op pool
(`tf_XLAEigen`) and the client's pool each have max(PJRT_NPROC or NPROC or the cores, devices)
threads — the floor of one thread per device is fixed in the CPU client ("at least CpuDeviceCount
threads to launch one collective"), so no setting runs 4 devices with fewer threads than devices.
That floor is not enough for a multi-device step (issue 38): XLA:CPU's in-process collectives
hold the pool thread that runs them until every participant arrives, and an 8-device step on a
2-core host (pools of 8) could have all of its `tf_XLAEigen` threads waiting in rendezvous while a
device that had not reached those collectives had its work queued on the same pool — a deadlock
that XLA:CPU ends with SIGABRT ("Termination timeout for `all gather RendezvousKey...`"). It showed
with executables compiled in the run (not loaded from the compilation cache) and XLA:CPU's
memory-optimized schedule, with a mesh over three axes (data x fsdp x tensor), and not with pools
of two threads per device, nor with a mesh over one axis (8 devices of data, fsdp or tensor alone,
2 and 4 of fsdp; benchmarks/RESULTS.md, "The 8-device abort"): a mesh over several axes runs
collectives of different device groups that can wait on each other's threads. So
`apply_thread_pools` sets `PJRT_NPROC` (the size XLA:CPU gives both pools) to
POOL_THREADS_PER_DEVICE threads per device for a multi-device single-process run whose mesh shards
over more than one axis (or whose mesh is not known), unless the user set `PJRT_NPROC` / `NPROC`
or the cores already give that many; before the backends start. A one-axis mesh keeps XLA's pools:
twice the threads on cores already busy slow its step (the 2-device fsdp row of the side-by-side
matrix).

What does reduce the contention is the order XLA:CPU runs each device's program in:
`apply_xla_defaults` sets XLA's memory-optimized (depth-first) schedule for CPU compiles unless the
user chose a schedule in XLA_FLAGS; XLA's default for a program with collectives is the
concurrency-optimized (breadth-first) one, which lets more independent ops of every device run at
once than the cores can take.

The host allocator (`keep_freed_memory`): XLA:CPU allocates every step's buffers anew (outputs,
and one block of temporaries per device, tens of MiB at the tiny config), and glibc's malloc
serves blocks above its mmap threshold (at most 32 MiB) with a fresh mmap each time and unmaps them
on free, so every step page-faults its temporaries in again and the kernel zero-fills them
(system time that grows with the step's temporaries). `apply_host_allocator` (on the CPU platform)
tells glibc to serve them from its heap and keep up to
`KEEP_FREED_BYTES` of freed memory for the next step, unless the user set glibc's malloc tunables
(`GLIBC_TUNABLES=glibc.malloc.*`, `MALLOC_*` variables) or the C library is not glibc. It acts on
host memory only; the cost is a higher peak RSS (the heap holds its high-water mark).
What it saves per step: benchmarks/RESULTS.md, the CPU settings.

The train step's compile (`step_compiler_options`, per jitted program, not process-wide): on the
tuned path XLA:CPU compiles the step with LLVM's optimisation level STEP_OPT_LEVEL (XLA's default
is 2). XLA:CPU turns every fusion of the step into its own kernel (MLIR fusion emitters, then LLVM),
so a cold compile is mostly per-kernel code generation; the matmuls and reductions run in library
kernels (YNNPACK, Eigen) that this level does not touch, and the elementwise kernels it does
touch vectorise alike at level 1. The step runs as fast and computes the same losses at either
level; the compile takes less CPU (benchmarks/RESULTS.md, "Compile time vs MaxText"; level 0, or
XLA's older emitters, compile faster still but run the step two to three times slower). A level
the user set in XLA_FLAGS (`--xla_backend_optimization_level=N`) stands: the step then compiles as
every other program of the process does (the test suite's cheap compile, tests/conftest.py).
"""
from __future__ import annotations

import ctypes
import os
import platform as host_platform
from typing import Any, Mapping, MutableMapping, NamedTuple

import jax

from MaxText.backend import compat, hot_path as hot
from MaxText.config.load import ConfigError
from MaxText.config.parallelism import fill_parallelism
from MaxText.config.schema import Config

# Beyond this many devices each one's batch and the collectives grow while one device's intra-op
# threads already use the cores; more can always be asked for with the flags above.
MAX_DEFAULT = 8
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
SCHEDULER_FLAG = "--xla_cpu_scheduler_type"
SCHEDULER_DEFAULT = "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"
# glibc's mallopt parameters (malloc.h) and how much freed memory the heap keeps (mallopt takes an int)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
KEEP_FREED_BYTES = 1 << 30
# XLA:CPU's thread pools per device of a multi-device run (module docstring: one deadlocks)
POOL_THREADS_PER_DEVICE = 2
POOL_ENV = "PJRT_NPROC"                  # read by XLA's DefaultThreadPoolSize(), then NPROC
# LLVM's optimisation level for the train step's XLA:CPU kernels on the tuned path (XLA's is 2)
STEP_OPT_LEVEL = 1


def usable_cores() -> int:
  try:
    return len(os.sched_getaffinity(0))   # honours taskset / cgroup cpusets
  except AttributeError:                  # not on Linux
    return os.cpu_count() or 1


def _jax_flag(name: str) -> Any:
  """jax.config's value of the flag `name` (its attributes are set at run time, one per flag)."""
  return getattr(jax.config, name)


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
    num_cpu_devices, platforms = _jax_flag("jax_num_cpu_devices"), _jax_flag("jax_platforms")
  if num_cpu_devices not in (-1, None):
    return "jax_num_cpu_devices"
  if platforms:
    return "jax_platforms"
  return ""


def _backends_started() -> bool:
  return compat.backends_started()


class Defaults(NamedTuple):
  """What `apply_default` set: the CPU device count (None: the user's or the backend's),
  whether this project's XLA:CPU schedule was added to XLA_FLAGS, whether the host allocator
  keeps freed memory (`keep_freed_memory`), and the XLA:CPU pools' threads it asked for
  (`apply_thread_pools`; None: XLA's own size)."""
  devices: int | None
  schedule: bool
  allocator: bool = False
  pool_threads: int | None = None


def apply_default(env: MutableMapping[str, str] | None = None, hot_path: str = "auto",
                  cfg: Config | None = None) -> Defaults:
  """Sets this project's default XLA:CPU flags (`apply_xla_defaults`, whatever the device count;
  part of the tuned hot path, so not with `hot_path=plain`), one CPU device per usable core (at
  most MAX_DEFAULT) if the user chose nothing, and XLA:CPU's thread pools for the run's device
  count and the mesh of `cfg` (`apply_thread_pools`; None: the mesh is not known); all only
  before the backends start."""
  env = os.environ if env is None else env
  schedule = hot.select_hot_path(hot_path, "cpu") == hot.TUNED and apply_xla_defaults(env)
  if _backends_started():
    return Defaults(None, schedule)
  count = None
  if not user_choice(env):
    count = max(1, min(usable_cores(), MAX_DEFAULT))
    jax.config.update("jax_num_cpu_devices", count)
  devices = count or cpu_device_count(env)
  axes = None if cfg is None or devices is None else sharded_axes(cfg, devices)
  pools = apply_thread_pools(devices, env, axes)
  return Defaults(count, schedule, pool_threads=pools)


def sharded_axes(cfg: Config, devices: int) -> int | None:
  """How many mesh axes of `cfg` split `devices` devices of one process; None where the mesh does
  not fit them (the mesh check says so, with its hint, once the devices exist)."""
  try:
    sizes = fill_parallelism(cfg.ici_parallelism(), devices, "ici", cfg.mesh_axes)
  except ConfigError:
    return None
  return sum(size > 1 for size in sizes)


def cpu_device_count(env: Mapping[str, str], num_cpu_devices: int | None = None) -> int | None:
  """The CPU device count the user set (XLA_FLAGS' DEVICE_COUNT_FLAG, JAX_NUM_CPU_DEVICES,
  jax.config's `jax_num_cpu_devices`: read from it when not given); None: none was set."""
  for flag in env.get("XLA_FLAGS", "").split():
    if flag.startswith(DEVICE_COUNT_FLAG + "="):
      try:
        return int(flag.split("=", 1)[1])
      except ValueError:
        return None
  try:
    return int(env["JAX_NUM_CPU_DEVICES"])
  except (KeyError, ValueError):
    pass
  if num_cpu_devices is None:
    num_cpu_devices = _jax_flag("jax_num_cpu_devices")
  return num_cpu_devices if num_cpu_devices not in (-1, None) else None


def apply_thread_pools(devices: int | None, env: MutableMapping[str, str] | None = None,
                       axes: int | None = None) -> int | None:
  """Sets POOL_ENV so that XLA:CPU's intra-op and client pools get POOL_THREADS_PER_DEVICE
  threads per CPU device (module docstring: with one per device an 8-device step over three mesh
  axes deadlocked); returns that size, or None where it leaves them alone: one device, a mesh
  sharded over one axis (`axes`; None: not known), the user's own PJRT_NPROC or NPROC, cores
  enough already, or the backends already started."""
  env = os.environ if env is None else env
  if devices is None or devices < 2 or (axes is not None and axes < 2) or _backends_started():
    return None
  if any(env.get(name, "").strip() for name in (POOL_ENV, "NPROC")):
    return None
  threads = POOL_THREADS_PER_DEVICE * devices
  if usable_cores() >= threads:
    return None
  env[POOL_ENV] = str(threads)
  return threads


def apply_host_allocator(defaults: Defaults | None, platform: str,
                         env: Mapping[str, str] | None = None,
                         hot_path: str = "auto") -> Defaults | None:
  """`keep_freed_memory` where the run takes the tuned hot path (`hot_path` on `platform`, the
  run's devices: CPUs by default, whose buffers are host memory; on an accelerator only host-side
  work uses malloc, and keeping its freed memory would only raise the peak); `defaults` None
  (apply_default did not run): nothing."""
  if defaults is None or hot.select_hot_path(hot_path, platform) != hot.TUNED:
    return defaults
  return defaults._replace(allocator=keep_freed_memory(env))


def _glibc() -> ctypes.CDLL | None:
  if host_platform.system() != "Linux" or host_platform.libc_ver()[0] != "glibc":
    return None
  try:
    return ctypes.CDLL("libc.so.6")
  except OSError:
    return None


def user_malloc_settings(env: Mapping[str, str]) -> bool:
  """Whether the user tuned glibc's malloc through the environment (then it is left alone)."""
  return "glibc.malloc." in env.get("GLIBC_TUNABLES", "") or any(k.startswith("MALLOC_") for k in env)


def keep_freed_memory(env: Mapping[str, str] | None = None, keep: bool = True) -> bool:
  """glibc's malloc serves large blocks from its heap (no mmap per block) and keeps up to
  KEEP_FREED_BYTES of freed memory instead of returning it to the kernel, so the buffers XLA:CPU
  allocates every step reuse pages already mapped (module docstring). Any time in the process
  (mallopt); returns whether it set anything (not glibc, or the user's own malloc settings: no).
  `keep=False` puts back glibc's thresholds as a long-running process adapts them (mmap above
  32 MiB, trim above 64 MiB: A/Bs, `benchmarks/ab_step.py`)."""
  env = os.environ if env is None else env
  libc = _glibc()
  if libc is None or user_malloc_settings(env):
    return False
  if keep:
    settings = ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, KEEP_FREED_BYTES))
  else:
    settings = ((M_MMAP_MAX, 65536), (M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, 64 << 20))
  return all([libc.mallopt(key, value) == 1 for key, value in settings])


def apply_xla_defaults(env: MutableMapping[str, str] | None = None) -> bool:
  """Adds this project's default XLA:CPU schedule to XLA_FLAGS (read when the backends start, so
  only before that) unless the user chose one; returns whether it did. Only `xla_cpu_*` flags:
  they change CPU compilations alone, whatever the platform."""
  env = os.environ if env is None else env
  current = env.get("XLA_FLAGS", "")
  if SCHEDULER_FLAG in current or _backends_started():
    return False
  env["XLA_FLAGS"] = " ".join([*current.split(), f"{SCHEDULER_FLAG}={SCHEDULER_DEFAULT}"])
  return True


def scheduler_note(defaulted: bool, env: Mapping[str, str] | None = None) -> str:
  """Which XLA:CPU schedule this process compiles with, and who chose it (`defaulted`: this
  project, `Defaults.schedule`)."""
  env = os.environ if env is None else env
  for flag in env.get("XLA_FLAGS", "").split():
    if flag.startswith(SCHEDULER_FLAG + "="):
      value = flag.split("=", 1)[1].removeprefix("CPU_SCHEDULER_TYPE_").lower().replace("_", "-")
      if defaulted:
        return f"XLA:CPU schedule {value}, by default (set XLA_FLAGS={SCHEDULER_FLAG}=... to choose)"
      return f"XLA:CPU schedule {value}, from XLA_FLAGS"
  return "XLA:CPU schedule: XLA's default"


OPT_LEVEL_FLAG = "--xla_backend_optimization_level"


def step_compiler_options(platform: str, hot_path: str = "auto") -> dict[str, int]:
  """The XLA compile options of the train step (`jax.jit(...).lower(...).compile(compiler_options=
  ...)`): on the CPU platform's tuned hot path, LLVM's optimisation level STEP_OPT_LEVEL (module
  docstring); elsewhere, or when XLA_FLAGS sets the level, none (XLA's flags). They are part of
  the compilation cache's key."""
  if platform != "cpu" or hot.select_hot_path(hot_path, platform) != hot.TUNED:
    return {}
  if any(f.startswith(OPT_LEVEL_FLAG + "=") for f in os.environ.get("XLA_FLAGS", "").split()):
    return {}
  return {"xla_backend_optimization_level": STEP_OPT_LEVEL}


def describe(defaults: Defaults | None, platform: str) -> str:
  """The note printed with the mesh: where the CPU device count came from, and the XLA:CPU
  schedule (`defaults`: what `apply_default` set; None: it did not run)."""
  if platform != "cpu":
    return ""
  count = defaults.devices if defaults else None
  chosen = "" if count is None else (
      f"one per core of {usable_cores()}, chosen by default; set "
      f"XLA_FLAGS={DEVICE_COUNT_FLAG}=N or JAX_NUM_CPU_DEVICES=N to choose; ")
  allocator = "; host allocator keeps freed memory" if defaults and defaults.allocator else ""
  pools = (f"; XLA:CPU pools of {defaults.pool_threads} threads ({POOL_THREADS_PER_DEVICE} per "
           f"device; {POOL_ENV} to choose)" if defaults and defaults.pool_threads else "")
  return f" ({chosen}{scheduler_note(bool(defaults and defaults.schedule))}{allocator}{pools})"
