"""The default CPU device count (`runtime/cpu_devices.py`): one device per usable core when the user
set nothing, and never when a device count or platform was chosen."""
import os
import subprocess
import sys

import pytest

from conftest import BASE_YML, ROOT
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
  collective's program compiled depth-first needs fewer temporary bytes than breadth-first. Both
  processes set JAX_NUM_CPU_DEVICES=2: the user's count wins (no default count, 2 devices)."""
  code = ("import os, jax, jax.numpy as jnp; from MaxText.runtime import cpu_devices; "
          "n = cpu_devices.apply_host_allocator(cpu_devices.apply_default(), 'cpu'); from jax.sharding import PartitionSpec as P; "
          "mesh = jax.make_mesh((2,), ('d',), axis_types=(jax.sharding.AxisType.Auto,)); "
          "body = lambda x, w: ([jnp.tanh(x @ w[i]) + jnp.tanh(jnp.tanh(x @ w[i]) @ w[i]) "
          "for i in range(4)], jax.lax.psum(x.sum(), 'd')); "
          "f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P('d'), P()), out_specs=(P('d'), P()))); "
          "c = f.lower(jnp.ones((512, 256)), jnp.ones((4, 256, 256))).compile(); "
          "print(n.devices, len(jax.devices()), jax.devices()[0].platform, "
          "c.memory_analysis().temp_size_in_bytes, cpu_devices.describe(n, 'cpu'))")
  env = {k: v for k, v in os.environ.items()
         if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "PJRT_NPROC", "NPROC")}
  runs = {}
  for flags in ("", f"{cpu_devices.SCHEDULER_FLAG}=CPU_SCHEDULER_TYPE_CONCURRENCY_OPTIMIZED"):
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env=dict(env, JAX_NUM_CPU_DEVICES="2", **({"XLA_FLAGS": flags} if flags else {})),
                         check=True).stdout.split(maxsplit=4)
    assert out[:3] == ["None", "2", "cpu"], out   # the user's count wins
    runs[flags] = out[2:]
  ours, theirs = runs[""], runs[f"{cpu_devices.SCHEDULER_FLAG}=CPU_SCHEDULER_TYPE_CONCURRENCY_OPTIMIZED"]
  allocator = "; host allocator keeps freed memory" if cpu_devices._glibc() else ""
  allocator += ("; XLA:CPU pools of 4 threads (2 per device; PJRT_NPROC to choose)"
                if cpu_devices.usable_cores() < 4 else "")   # apply_thread_pools at 2 devices
  assert ours[2].strip() == ("(XLA:CPU schedule memory-optimized, by default (set "
                             f"XLA_FLAGS={cpu_devices.SCHEDULER_FLAG}=... to choose){allocator})")
  assert theirs[2].strip() == f"(XLA:CPU schedule concurrency-optimized, from XLA_FLAGS{allocator})"
  assert int(ours[1]) < int(theirs[1])


FAULTS_PROBE = """
import ctypes, resource, sys
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
on = False
if sys.argv[1] == "keep":   # glibc's default needs no MaxText (nor the jax it imports)
  from MaxText.runtime import cpu_devices
  on = cpu_devices.keep_freed_memory()
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


def test_cpu_device_count_the_user_set():
  flags = {"XLA_FLAGS": f"--xla_cpu_enable_fast_math=false {cpu_devices.DEVICE_COUNT_FLAG}=8"}
  assert cpu_devices.cpu_device_count(flags, num_cpu_devices=-1) == 8
  assert cpu_devices.cpu_device_count({"JAX_NUM_CPU_DEVICES": "3"}, num_cpu_devices=-1) == 3
  assert cpu_devices.cpu_device_count({}, num_cpu_devices=4) == 4
  assert cpu_devices.cpu_device_count({}, num_cpu_devices=-1) is None


def test_thread_pools_get_two_threads_per_device(monkeypatch):
  """Issue 38: with XLA's floor of one pool thread per device an 8-device step over three mesh
  axes deadlocked in its collectives (benchmarks/RESULTS.md); a multi-device run over several
  axes (or an unknown mesh) asks for two per device, unless the user sized the pools or the cores
  give that many already; a mesh over one axis keeps XLA's pools."""
  monkeypatch.setattr(cpu_devices, "_backends_started", lambda: False)
  monkeypatch.setattr(cpu_devices, "usable_cores", lambda: 2)
  env = {}
  assert cpu_devices.apply_thread_pools(8, env) == 16 and env == {"PJRT_NPROC": "16"}
  assert cpu_devices.apply_thread_pools(8, env := {}, axes=3) == 16 and env == {"PJRT_NPROC": "16"}
  for axes in (0, 1):
    assert cpu_devices.apply_thread_pools(8, env := {}, axes=axes) is None and env == {}
  from MaxText.config.load import load_config

  def mesh(*keys):
    return load_config([BASE_YML, *keys], keep_auto=True)
  for keys, devices, want in (((), 2, 1), ((), 1, 0), (("ici_tensor_parallelism=2",), 8, 2),
                              (("ici_tensor_parallelism=2",), 2, 1),
                              (("ici_data_parallelism=2", "ici_fsdp_parallelism=2",
                                "ici_tensor_parallelism=2"), 8, 3),
                              (("ici_tensor_parallelism=3",), 8, None)):   # does not fit: unknown
    assert cpu_devices.sharded_axes(mesh(*keys), devices) == want, (keys, devices)
  for keys, pools in (((), None), (("ici_tensor_parallelism=2",), 16),
                      (("ici_tensor_parallelism=3",), 16)):
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    assert cpu_devices.apply_default(env, cfg=mesh(*keys)).pool_threads == pools
    assert env.get("PJRT_NPROC") == (str(pools) if pools else None)
  for devices in (None, 1):
    assert cpu_devices.apply_thread_pools(devices, env := {}) is None and env == {}
  for mine in ({"PJRT_NPROC": "8"}, {"NPROC": "4"}):
    assert cpu_devices.apply_thread_pools(8, env := dict(mine)) is None and env == mine
  monkeypatch.setattr(cpu_devices, "usable_cores", lambda: 16)
  assert cpu_devices.apply_thread_pools(8, env := {}) is None and env == {}
  assert cpu_devices.describe(cpu_devices.Defaults(None, False, False, 16), "cpu").endswith(
      "; XLA:CPU pools of 16 threads (2 per device; PJRT_NPROC to choose))")


POOLS_PROBE = """
import glob, jax, jax.numpy as jnp
from MaxText.runtime import cpu_devices
d = cpu_devices.apply_default()
mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
f = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "d"), mesh=mesh,
                          in_specs=jax.P("d"), out_specs=jax.P()))
f(jnp.ones(8)).block_until_ready()
names = [open(p).read().strip() for p in glob.glob("/proc/self/task/*/comm")]
print(d.pool_threads, names.count("tf_XLAEigen"))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="counts threads in /proc")
def test_the_thread_pools_reach_xla():
  """apply_default's PJRT_NPROC reaches XLA:CPU: an 8-device process (the user's XLA_FLAGS) gets
  intra-op pools of two threads per device where the cores are fewer; the user's PJRT_NPROC
  stays (XLA's floor of one per device still applies)."""
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "PJRT_NPROC", "NPROC")}
  env["XLA_FLAGS"] = f"{cpu_devices.DEVICE_COUNT_FLAG}=8"
  runs = {}
  for mine in ("", "9"):
    out = subprocess.run([sys.executable, "-c", POOLS_PROBE], cwd=ROOT,
                         env=dict(env, **({"PJRT_NPROC": mine} if mine else {})),
                         capture_output=True, text=True, check=True).stdout.split()
    runs[mine] = out
  cores = cpu_devices.usable_cores()
  assert runs[""] == ([str(16), "16"] if cores < 16 else ["None", str(cores)])
  assert runs["9"] == ["None", "9"]


@pytest.mark.skipif(not os.environ.get("MAXTEXT_SLOW_TESTS"),
                    reason="minutes of CPU (a cold compile of the 8-device step): set "
                           "MAXTEXT_SLOW_TESTS=1")
@pytest.mark.timeout(1200)   # a cold compile of the 8-device step: over pytest.ini's limit
def test_an_8_device_step_compiled_afresh_does_not_abort(tmp_path):
  """Issue 38's run: the default model on 8 CPU devices (data x fsdp x tensor = 2 x 2 x 2), its
  step compiled in the run (compilation cache off). With XLA:CPU's pools of one thread per device
  it aborted on a 2-core host (SIGABRT after a stuck collective rendezvous,
  benchmarks/RESULTS.md); with apply_thread_pools' two per device it finishes."""
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "PJRT_NPROC", "NPROC")}
  env["XLA_FLAGS"] = f"{cpu_devices.DEVICE_COUNT_FLAG}=8"
  p = subprocess.run(
      [sys.executable, "train.py", "configs/base.yml", "dataset_type=synthetic", "steps=3",
       "dtype=float32", "per_device_batch_size=1", "ici_data_parallelism=2",
       "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2", "jax_cache_dir=",
       "sample_at_end=false", f"base_output_directory={tmp_path}", "run_name=x8"],
      cwd=ROOT, env=env, capture_output=True, text=True)
  assert p.returncode == 0, p.stderr[-3000:]
  assert "may be stuck" not in p.stderr


def test_the_train_step_compile_options_are_the_cpu_tuned_paths_only(monkeypatch):
  user = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                  if not f.startswith(cpu_devices.OPT_LEVEL_FLAG + "="))
  monkeypatch.setenv("XLA_FLAGS", user)
  level = {"xla_backend_optimization_level": cpu_devices.STEP_OPT_LEVEL}
  assert cpu_devices.step_compiler_options("cpu") == level
  assert cpu_devices.step_compiler_options("cpu", "tuned") == level
  assert cpu_devices.step_compiler_options("cpu", "plain") == {}
  for platform in ("gpu", "cuda", "tpu"):
    assert cpu_devices.step_compiler_options(platform) == {}
    assert cpu_devices.step_compiler_options(platform, "tuned") == {}
  # a level set in XLA_FLAGS stands (the suite's cheap compile, tests/conftest.py)
  monkeypatch.setenv("XLA_FLAGS", f"{user} {cpu_devices.OPT_LEVEL_FLAG}=3")
  assert cpu_devices.step_compiler_options("cpu") == {}


def _three_steps(tmp_path, monkeypatch, dtype: str, compiles: dict) -> dict:
  """{name: (the (loss, grad norm) of each of three steps of the tiny model, the initial and the
  final parameters)} per XLA compile options of `compiles`, from the same state and batch."""
  import jax
  import numpy as np

  from conftest import MESH_1, argv
  from MaxText.config.load import load_config
  from MaxText.train.loop import Trainer
  from MaxText.train.state import init_state

  trainer = Trainer(load_config(argv(tmp_path, "lvl", f"dtype={dtype}", "jax_cache_dir=",
                                     *MESH_1)), jax.devices()[:1])
  rng = np.random.default_rng(0)
  B, S = trainer.global_batch, trainer.cfg.max_target_length
  host = {k: rng.integers(1, trainer.mcfg.vocab_size, (B, S)).astype(np.int32)
          for k in ("inputs", "targets")}
  host.update(inputs_segmentation=np.ones((B, S), np.int32),
              targets_segmentation=np.ones((B, S), np.int32),
              inputs_position=np.tile(np.arange(S, dtype=np.int32), (B, 1)))
  batch = trainer.device_batch(host)
  out = {}
  for name, options in compiles.items():
    monkeypatch.setattr(cpu_devices, "step_compiler_options", lambda *_a, o=options, **_k: o)
    compiled = trainer.compile_step()
    state, rows = init_state(trainer.mcfg, 0, trainer.tx, trainer.shardings), []
    initial = jax.tree.map(np.asarray, state["params"])
    for _ in range(3):   # the first at the warm-up's rate 0
      state, metrics = compiled(state, batch)
      rows.append((float(metrics["loss"]), float(metrics["grad_norm"])))
    out[name] = rows, initial, jax.tree.map(np.asarray, state["params"])
  return out


def test_the_train_step_at_the_chosen_llvm_level_computes_what_xlas_default_level_does(
    tmp_path, monkeypatch):
  """Three steps of the tiny model in bf16 compute (the users' default; the elementwise kernels
  the level changes run in bf16 and fp32), compiled by `Trainer.compile_step` at STEP_OPT_LEVEL
  and at XLA's default level 2 with XLA's default (fusion) emitters, as a user's run compiles
  them, from the same state and batch: bit-identical losses, gradient norms and parameters.

  And the test suite's cheap compile (its XLA_FLAGS: LLVM level 0 without its expensive passes,
  the older emitters; tests/conftest.py) computes the users' steps within fp32 rounding, so what
  the suite checks holds for the users' compile. That comparison is in fp32 compute, as the
  suite's exact comparisons are (conftest.TINY): in bf16 the two emitters may round an
  intermediate to bf16 at different places, a difference of bf16's eps (2^-8) in one value that
  no fp32-sized tolerance covers (issue 58: on an AMD EPYC the step-3 gradient norm differed by
  1.07e-4 relative, 5.037452 against 5.037992, while both compiles agree to the bit on others)."""
  import jax
  import numpy as np

  from conftest import SUITE_COMPILE

  assert cpu_devices.STEP_OPT_LEVEL != 2
  users = {"xla_cpu_use_fusion_emitters": True}
  level = {**users, "xla_backend_optimization_level": cpu_devices.STEP_OPT_LEVEL}
  bf16 = _three_steps(tmp_path, monkeypatch, "bfloat16", {
      "chosen": level, "default": {**users, "xla_backend_optimization_level": 2}})
  (rows_a, _, params_a), (rows_b, _, params_b) = bf16.values()
  assert rows_a == rows_b and rows_a[2][0] < rows_a[0][0]
  jax.tree.map(np.testing.assert_array_equal, params_a, params_b)

  fp32 = _three_steps(tmp_path, monkeypatch, "float32", {"users": level, "suite": SUITE_COMPILE})
  (rows_u, initial, params_u), (rows_s, _, params_s) = fp32.values()
  # the loss (a mean of 512 token losses) and the gradient norm (a root of a sum of squares) are
  # sums of terms of one sign, whose relative rounding error a change of summation order keeps
  # within a few units of fp32's eps (1.19e-7) per halving of the sum: 2e-6 is 17 of them (seen:
  # 1.8e-7, about 1.5 eps)
  np.testing.assert_allclose(rows_s, rows_u, rtol=2e-6)
  # the parameters, per array, against how far the two Adam steps at a rate > 0 moved them: Adam
  # divides each element's gradient by its own magnitude (+ adam_eps 1e-8), so for the few elements
  # whose gradient is within rounding of zero the compiles' last-bit differences grow up to
  # 1/adam_eps-fold (seen: 9.1e-6 in 2 of 16,384 elements of a layer's MLP down projection, whose
  # other elements agree to 1e-7); a norm over the array holds the rest to fp32 rounding and stays
  # below 1e-3 of the movement (seen: 1.9e-5) unless the step computed something else
  for u, s, p0 in zip(jax.tree.leaves(params_u), jax.tree.leaves(params_s),
                      jax.tree.leaves(initial)):
    moved = np.linalg.norm(u - p0)
    assert moved > 0 and np.linalg.norm(s - u) <= 1e-3 * moved, (u.shape,
                                                                  np.linalg.norm(s - u), moved)
