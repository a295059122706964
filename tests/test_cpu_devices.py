"""The default CPU device count (`runtime/cpu_devices.py`): one device per usable core when the user
set nothing, and never when a device count or platform was chosen."""
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from MaxText.runtime import cpu_devices

PROBE = ("from MaxText.runtime import cpu_devices; n = cpu_devices.apply_default().devices; "
         "import jax; print(n, len(jax.devices()), jax.devices()[0].platform)")


@pytest.mark.parametrize("env,chosen", [
    ({}, ""),
    ({"XLA_FLAGS": "--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=4"},
     "XLA_FLAGS"),
    ({"JAX_NUM_CPU_DEVICES": "3"}, "JAX_NUM_CPU_DEVICES"),
    ({"JAX_PLATFORMS": "cpu"}, "JAX_PLATFORMS"),
    ({"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"}, ""),
])
def test_user_choice_from_the_environment(env, chosen):
  got = cpu_devices.user_choice(env, num_cpu_devices=-1, platforms=None)
  assert got.startswith(chosen) if chosen else got == ""


def test_no_change_once_the_backend_runs():
  assert cpu_devices.apply_default({}).devices is None   # this process has its 8 test devices


def _probe(**env_extra):
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  env.update(env_extra)
  out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True,
                       text=True, check=True).stdout.split()
  return out


def test_one_device_per_core_when_nothing_is_set():
  want = min(cpu_devices.usable_cores(), cpu_devices.MAX_DEFAULT)
  assert _probe() == [str(want), str(want), "cpu"]


def test_user_count_wins():
  assert _probe(JAX_NUM_CPU_DEVICES="3") == ["None", "3", "cpu"]


def test_user_choice_through_jax_config():
  assert cpu_devices.user_choice({}, num_cpu_devices=2, platforms=None) == "jax_num_cpu_devices"
  assert cpu_devices.user_choice({}, num_cpu_devices=-1, platforms="cpu") == "jax_platforms"


def test_xla_defaults_only_where_the_user_chose_no_schedule(monkeypatch):
  monkeypatch.setattr(cpu_devices, "_backends_started", lambda: False)
  env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
  assert cpu_devices.apply_xla_defaults(env) is True
  assert env["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=4",
                                      f"{cpu_devices.SCHEDULER_FLAG}={cpu_devices.SCHEDULER_DEFAULT}"]
  mine = {"XLA_FLAGS": f"{cpu_devices.SCHEDULER_FLAG}=CPU_SCHEDULER_TYPE_CONCURRENCY_OPTIMIZED"}
  assert cpu_devices.apply_xla_defaults(mine) is False
  assert cpu_devices.scheduler_note(False, mine) == (
      "XLA:CPU schedule concurrency-optimized, from XLA_FLAGS")
  assert cpu_devices.scheduler_note(True, env).startswith(
      "XLA:CPU schedule memory-optimized, by default")
  assert cpu_devices.scheduler_note(False, {}) == "XLA:CPU schedule: XLA's default"
  assert cpu_devices.describe(None, "gpu") == ""
  assert cpu_devices.describe(None, "cpu").startswith(" (XLA:CPU schedule")   # with the mesh line


def test_no_xla_flags_once_the_backend_runs():
  import jax  # pylint: disable=import-outside-toplevel
  jax.devices()   # starts this process's backends (conftest's 8 CPU devices)
  env = {}
  assert cpu_devices.apply_xla_defaults(env) is False and env == {}


def test_the_default_schedule_reaches_the_compiler():
  """The flag set by apply_default after jax is imported still changes the compiled program: a
  collective's program compiled depth-first needs fewer temporary bytes than breadth-first."""
  code = ("import os, jax, jax.numpy as jnp; from MaxText.runtime import cpu_devices; "
          "n = cpu_devices.apply_host_allocator(cpu_devices.apply_default(), 'cpu'); from jax.sharding import PartitionSpec as P; "
          "mesh = jax.make_mesh((2,), ('d',), axis_types=(jax.sharding.AxisType.Auto,)); "
          "body = lambda x, w: ([jnp.tanh(x @ w[i]) + jnp.tanh(jnp.tanh(x @ w[i]) @ w[i]) "
          "for i in range(4)], jax.lax.psum(x.sum(), 'd')); "
          "f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P('d'), P()), out_specs=(P('d'), P()))); "
          "c = f.lower(jnp.ones((512, 256)), jnp.ones((4, 256, 256))).compile(); "
          "print(n.devices, c.memory_analysis().temp_size_in_bytes, cpu_devices.describe(n, 'cpu'))")
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  runs = {}
  for flags in ("", f"{cpu_devices.SCHEDULER_FLAG}=CPU_SCHEDULER_TYPE_CONCURRENCY_OPTIMIZED"):
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env=dict(env, JAX_NUM_CPU_DEVICES="2", **({"XLA_FLAGS": flags} if flags else {})),
                         check=True).stdout.split(maxsplit=2)
    runs[flags] = out
  ours, theirs = runs[""], runs[f"{cpu_devices.SCHEDULER_FLAG}=CPU_SCHEDULER_TYPE_CONCURRENCY_OPTIMIZED"]
  allocator = "; host allocator keeps freed memory" if cpu_devices._glibc() else ""
  assert ours[2].strip() == ("(XLA:CPU schedule memory-optimized, by default (set "
                             f"XLA_FLAGS={cpu_devices.SCHEDULER_FLAG}=... to choose){allocator})")
  assert theirs[2].strip() == f"(XLA:CPU schedule concurrency-optimized, from XLA_FLAGS{allocator})"
  assert int(ours[1]) < int(theirs[1])


FAULTS_PROBE = """
import ctypes, resource, sys
from MaxText.runtime import cpu_devices
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
on = cpu_devices.keep_freed_memory() if sys.argv[1] == "keep" else False
def cycle(size=64 << 20):   # a buffer above glibc's largest mmap threshold, written and freed
  f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  p = libc.malloc(size)
  ctypes.memset(p, 1, size)
  libc.free(p)
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
cycle()
print(on, min(cycle() for _ in range(3)))
"""


@pytest.mark.skipif(cpu_devices._glibc() is None, reason="glibc's malloc only")
def test_the_host_allocator_keeps_freed_memory():
  """With `keep_freed_memory` a large buffer allocated again reuses mapped pages (no page faults);
  glibc's default maps it afresh each time. The user's own malloc settings are left alone."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
  runs = {}
  for mode in ("keep", "glibc"):
    out = subprocess.run([sys.executable, "-c", FAULTS_PROBE, mode], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True).stdout.split()
    runs[mode] = (out[0], int(out[1]))
  assert runs["keep"][0] == "True" and runs["glibc"][0] == "False"
  assert runs["keep"][1] * 8 < runs["glibc"][1], runs   # 16k faults of 4 KiB pages, or 32 of 2 MiB
  assert cpu_devices.keep_freed_memory({"GLIBC_TUNABLES": "glibc.malloc.mmap_max=4"}) is False
  assert cpu_devices.keep_freed_memory({"MALLOC_TRIM_THRESHOLD_": "0"}) is False
  assert cpu_devices.apply_host_allocator(cpu_devices.Defaults(None, True), "gpu").allocator is False
  assert cpu_devices.apply_host_allocator(None, "cpu") is None
  assert cpu_devices.describe(cpu_devices.Defaults(None, True, True), "cpu").endswith(
      "; host allocator keeps freed memory)")
