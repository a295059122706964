"""Peak dense bf16 throughput per device, used as the MFU denominator.

Known accelerators are looked up in a table of vendor figures (dense, no
sparsity, bf16, TFLOP/s per chip).  A CPU has no meaningful datasheet figure
for our purposes, so its "peak" is measured once per process: the best
achieved rate of a jitted fp32 matmul.  A config value > 0 overrides both.

When several XLA:CPU devices are faked on one host
(``--xla_force_host_platform_device_count``) they share the same cores, so
the measured host rate is split evenly between them: per-device MFU then
sums to the host's utilisation instead of over-counting it N times.
"""

from __future__ import annotations

import time

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

_MEASURED_HOST_TFLOPS: float | None = None


def lookup_peak_tflops(device_kind: str) -> float | None:
  """Table peak for a ``device_kind`` string, or None when it is not known."""
  kind = device_kind.lower()
  for needles, _name, tflops in PEAK_TFLOPS_TABLE:
    if all(n in kind for n in needles):
      return tflops
  return None


def measure_host_matmul_tflops(size: int = 1024, warmup: int = 2, reps: int = 5) -> float:
  """Best achieved TFLOP/s of a jitted ``size x size`` fp32 matmul on the CPU backend.

  The result is cached for the life of the process (only the first call
  pays the ~1 s it takes).
  """
  global _MEASURED_HOST_TFLOPS
  if _MEASURED_HOST_TFLOPS is not None:
    return _MEASURED_HOST_TFLOPS

  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  cpu = jax.local_devices(backend="cpu")[0]  # this process's own (in a multi-process run too)
  key_a, key_b = jax.random.split(jax.random.key(0))
  a = jax.device_put(jax.random.normal(key_a, (size, size), jnp.float32), cpu)
  b = jax.device_put(jax.random.normal(key_b, (size, size), jnp.float32), cpu)
  matmul = jax.jit(jnp.matmul)
  for _ in range(warmup):
    matmul(a, b).block_until_ready()
  best = float("inf")
  for _ in range(reps):
    start = time.perf_counter()
    matmul(a, b).block_until_ready()
    best = min(best, time.perf_counter() - start)
  _MEASURED_HOST_TFLOPS = 2.0 * size**3 / best / 1e12
  return _MEASURED_HOST_TFLOPS


def _num_cpu_devices() -> int:
  """How many XLA:CPU devices this process sees (fake host devices included)."""
  import jax  # pylint: disable=import-outside-toplevel

  try:
    return max(1, len(jax.local_devices(backend="cpu")))
  except RuntimeError:
    return 1


def device_peak_tflops(device, override: float = 0.0) -> tuple[float, str]:
  """Peak TFLOP/s of one device and where the figure came from.

  Args:
    device: a ``jax.Device`` (anything with ``device_kind`` and ``platform``).
    override: a configured peak; used when > 0.

  Returns:
    ``(tflops, source)`` with source one of ``"config"``, ``"table"``,
    ``"measured"`` (CPU), or ``"unknown"`` (tflops 0.0: MFU cannot be given).
  """
  if override and override > 0:
    return float(override), "config"
  kind = str(getattr(device, "device_kind", "") or "")
  platform = str(getattr(device, "platform", "") or "").lower()
  if platform == "cpu" or kind.lower() == "cpu":
    return measure_host_matmul_tflops() / _num_cpu_devices(), "measured"
  peak = lookup_peak_tflops(kind)
  if peak is not None:
    return peak, "table"
  return 0.0, "unknown"
