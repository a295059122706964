"""Peak dense throughput per device, used as the MFU denominator.

Known accelerators are looked up in a table of vendor figures (dense, no
sparsity, bf16, TFLOP/s per chip).  A CPU has no meaningful datasheet figure
for our purposes, so its "peak" is measured: the best rate of a jitted matmul
in the run's compute dtype (bf16 operands with fp32 accumulation for bf16, the
form our layers use; fp32 otherwise), over all cores.  It is measured once per
machine (CPU model, usable cores, dtype, jax version) and cached in
``~/.cache/maxtext/cpu_peak.json`` (``MAXTEXT_CPU_PEAK_CACHE`` moves it), so
runs read MFU against the same figure and do not pay for the measurement.  A
measurement made while the machine was busy (1-minute load average above half
the cores; three times as many repetitions, the best kept) is cached too but
marked: runs use it (`Peak.under_load`: every progress line's MFU says so)
until a run starts on a quiet machine, which measures again and replaces it.
Delete the file to re-measure.  A config value > 0 overrides all of this.

When several XLA:CPU devices are faked on one host
(``--xla_force_host_platform_device_count``) they share the same cores, so
the measured host rate is split evenly between them: per-device MFU then
sums to the host's utilisation instead of over-counting it N times.
"""

from __future__ import annotations

import json
import os
import platform
import time
from typing import NamedTuple

# (substrings that must all appear in the lower-cased device_kind, name, TFLOP/s).
# Order matters: more specific entries come first ("h200" before "h100",
# "v5 lite" before the bare "tpu v5" that JAX reports for v5p).
PEAK_TFLOPS_TABLE: tuple[tuple[tuple[str, ...], str, float], ...] = (
    (("h200",), "H200", 989.0),
    (("h100",), "H100 SXM", 989.0),
    (("a100",), "A100", 312.0),
    (("tpu", "v5 lite"), "TPU v5e", 197.0),
    (("tpu", "v5e"), "TPU v5e", 197.0),
    (("tpu", "v5p"), "TPU v5p", 459.0),
    (("tpu", "v5"), "TPU v5p", 459.0),
    (("tpu", "v6 lite"), "TPU v6e", 918.0),
    (("tpu", "v6e"), "TPU v6e", 918.0),
)

_MEASURED_HOST_TFLOPS: dict[str, float] = {}   # this process's measurements, by dtype
CACHE_ENV = "MAXTEXT_CPU_PEAK_CACHE"


class Peak(NamedTuple):
  """A device's peak TFLOP/s, where the figure came from, and whether it was measured while the
  machine was busy (an MFU against it is then not comparable with a quiet machine's)."""
  tflops: float
  source: str
  under_load: bool = False


def lookup_peak_tflops(device_kind: str) -> float | None:
  """Table peak for a ``device_kind`` string, or None when it is not known."""
  kind = device_kind.lower()
  for needles, _name, tflops in PEAK_TFLOPS_TABLE:
    if all(n in kind for n in needles):
      return tflops
  return None


def measure_host_matmul_tflops(dtype: str = "float32", size: int = 1024, warmup: int = 2,
                               reps: int = 10) -> float:
  """Best achieved TFLOP/s of a jitted ``size x size`` matmul on the CPU backend, with operands
  in ``dtype`` and fp32 accumulation (measured once per process and dtype)."""
  if dtype in _MEASURED_HOST_TFLOPS:
    return _MEASURED_HOST_TFLOPS[dtype]

  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  cpu = jax.local_devices(backend="cpu")[0]  # this process's own (in a multi-process run too)
  key_a, key_b = jax.random.split(jax.random.key(0))
  a = jax.device_put(jax.random.normal(key_a, (size, size), jnp.float32).astype(dtype), cpu)
  b = jax.device_put(jax.random.normal(key_b, (size, size), jnp.float32).astype(dtype), cpu)
  matmul = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
  for _ in range(warmup):
    matmul(a, b).block_until_ready()
  best = float("inf")
  for _ in range(reps):
    start = time.perf_counter()
    matmul(a, b).block_until_ready()
    best = min(best, time.perf_counter() - start)
  _MEASURED_HOST_TFLOPS[dtype] = 2.0 * size**3 / best / 1e12
  return _MEASURED_HOST_TFLOPS[dtype]


def cache_path() -> str:
  return os.environ.get(CACHE_ENV) or os.path.expanduser("~/.cache/maxtext/cpu_peak.json")


def _machine_key(dtype: str) -> str:
  import jax  # pylint: disable=import-outside-toplevel
  model = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      model = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), model)
  except OSError:
    pass
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  return f"{model} | {cores} cores | {dtype} | jax {jax.__version__}"


def _read_cache() -> dict:
  try:
    with open(cache_path(), encoding="utf-8") as f:
      data = json.load(f)
    return data if isinstance(data, dict) else {}
  except (OSError, ValueError):
    return {}


def _write_cache(data: dict) -> None:
  path = cache_path()
  try:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
  except OSError:
    pass  # an unwritable cache only means measuring again next time


def _load_and_cores() -> tuple[float, int]:
  load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
  return load, cores


def host_peak_tflops(dtype: str = "float32") -> Peak:
  """The host's TFLOP/s for matmuls in `dtype`, from the per-machine cache, else measured (and
  cached, marked when measured under load); a cached figure measured under load is measured
  again when the machine is quiet now."""
  key = _machine_key(dtype)
  entry = _read_cache().get(key)
  load, cores = _load_and_cores()
  quiet = load <= cores / 2
  if isinstance(entry, dict) and entry.get("tflops", 0) > 0:
    loaded_then = bool(entry.get("under_load", False))
    if not loaded_then or not quiet:
      when = entry.get("measured", "?")
      if loaded_then:
        return Peak(float(entry["tflops"]), (
            f"{dtype} matmul peak of this host measured {when} under load "
            f"{entry.get('load', '?')} on {cores} cores, cached in {cache_path()}; measured again "
            f"when a run starts on a quiet machine"), True)
      return Peak(float(entry["tflops"]),
                  f"{dtype} matmul peak of this host measured {when}, cached in {cache_path()}")
  tflops = measure_host_matmul_tflops(dtype, reps=10 if quiet else 30)
  data = _read_cache()
  data[key] = {"tflops": tflops, "measured": time.strftime("%Y-%m-%d %H:%M"),
               "load": round(load, 2), "under_load": not quiet}
  _write_cache(data)
  if not quiet:
    return Peak(tflops, (f"{dtype} matmul peak measured now under load {load:.1f} on {cores} "
                         f"cores, cached in {cache_path()}; measured again when a run starts on "
                         f"a quiet machine"), True)
  return Peak(tflops, f"{dtype} matmul peak of this host measured now, cached in {cache_path()}")


def _num_cpu_devices() -> int:
  """How many XLA:CPU devices this process sees (fake host devices included)."""
  import jax  # pylint: disable=import-outside-toplevel

  try:
    return max(1, len(jax.local_devices(backend="cpu")))
  except RuntimeError:
    return 1


def device_peak_tflops(device, override: float = 0.0, dtype: str = "float32") -> Peak:
  """Peak TFLOP/s of one device and where the figure came from.

  Args:
    device: a ``jax.Device`` (anything with ``device_kind`` and ``platform``).
    override: a configured peak; used when > 0.
    dtype: the compute dtype (the CPU peak is measured for it).

  Returns:
    ``Peak(tflops, source, under_load)`` with source ``"config"``, ``"table"``, ``"unknown"``
    (tflops 0.0: MFU cannot be given), or for a CPU a sentence saying where the measurement came
    from.
  """
  if override and override > 0:
    return Peak(float(override), "config")
  kind = str(getattr(device, "device_kind", "") or "")
  platform_name = str(getattr(device, "platform", "") or "").lower()
  if platform_name == "cpu" or kind.lower() == "cpu":
    host = host_peak_tflops(dtype)
    return host._replace(tflops=host.tflops / _num_cpu_devices())
  peak = lookup_peak_tflops(kind)
  if peak is not None:
    return Peak(peak, "table")
  return Peak(0.0, "unknown")
