"""Test setup: 8 fake CPU devices (set before jax is imported), the persistent compilation cache,
and a `train` helper that runs the trainer in-process on a tiny model."""
import os
from typing import Sequence

# The suite compiles hundreds of tiny programs and runs each a few times: compiling is the largest
# part of its time, so XLA:CPU compiles cheaply, for programs that run slower: LLVM at level 0
# without its expensive passes, XLA's older (LLVM IR) fusion emitters rather than its MLIR ones,
# and each program's code as one LLVM module (not split for a parallel compile the two workers
# have no cores for). XLA's HLO passes are the default build's (the programs' shapes, shardings and
# buffers), and float arithmetic is kept as written (fast-math is off, XLA:CPU's default), so the
# values agree with the users' compile within rounding (tests/test_cpu_devices.py runs the train
# step both ways, in fp32 compute: in bf16 the two emitters may round an intermediate to bf16 at
# different places). Two programs that compute the same bits at the users' compile (the fused AdamW
# and optax's chain) may differ in the last bit under the older emitters on some CPUs (an Intel
# Xeon, not an AMD EPYC): the tests of such pairs compile them with the users' emitters
# (USERS_EMITTERS, `users_emitters`). Sums split across processes rather than devices of one
# process may differ in the last bits (tests/test_hf_sharded.py). The train step's own level
# (MaxText/runtime/cpu_devices.step_compiler_options) yields to the level set here. Subprocesses
# the tests start inherit the flags (`xla_flags`, another device count).
SUITE_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True,
                 "xla_cpu_use_fusion_emitters": False, "xla_cpu_parallel_codegen_split_count": 1}
USERS_EMITTERS = {"xla_cpu_use_fusion_emitters": True}
SUITE_XLA_FLAGS = " ".join(["--xla_force_host_platform_device_count=8",
                            *(f"--{k}={str(v).lower()}" for k, v in SUITE_COMPILE.items())])
# On the TPU chip (the `tpu` tests: JAX_PLATFORMS=tpu,cpu, tests/test_tpu.py) the XLA flags stay the
# machine's own: the suite's cheap-compile flags are XLA:CPU's, and its optimization level would
# reach the TPU's compile too.
ON_TPU = "tpu" in os.environ.get("JAX_PLATFORMS", "")
if not ON_TPU:
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + SUITE_XLA_FLAGS).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def xla_flags(devices: int | None) -> str:
  """XLA_FLAGS for a subprocess with `devices` fake CPU devices and the suite's other flags: the
  persistent cache's key includes the flags (the device count aside), so a subprocess started
  with other flags compiles every program afresh, and with LLVM's expensive passes. None: no
  device count (the process's own choice, e.g. JAX_NUM_CPU_DEVICES or one device)."""
  kept = [f for f in os.environ["XLA_FLAGS"].split()
          if not f.startswith("--xla_force_host_platform_device_count=")]
  if devices is None:
    return " ".join(kept)
  return " ".join([*kept, f"--xla_force_host_platform_device_count={devices}"])
# two XLA:CPU pool threads per fake device, as train.py sets them (MaxText/runtime/cpu_devices.py
# apply_thread_pools): with XLA's floor of one per device an 8-device step compiled afresh can
# abort on a collective rendezvous time-out (benchmarks/RESULTS.md, "The 8-device abort")
os.environ.setdefault("PJRT_NPROC", "16")
# torch (the transformers / peft / TRL oracles) and NumPy's BLAS on one OpenMP thread, here and in
# the subprocesses: the oracles' tiny models gain nothing from a second thread, and OpenMP's
# threads spin-wait between the many small ops, taking the core the other worker needs (the torch
# oracles' files cost a quarter more CPU on two threads). XLA:CPU's own thread pool ignores it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# the persistent cache keeps every program, however quick to compile (jax reads this variable; the
# trainer keeps it, and subprocesses inherit it): a warm run compiles nothing, and a program that
# two test files share compiles once in a cold run
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
CACHE_DIR = os.path.expanduser(os.environ.get("MAXTEXT_TEST_JAX_CACHE", "~/.cache/maxtext_jax_tests"))


def tool_home(tmp_path) -> str:
  """A HOME for a subprocess that runs a tool as documented (no jax_cache_dir: base.yml's
  ~/.cache/maxtext_jax): there that folder is a link to the suite's cache, so the tool neither
  writes into the user's own cache nor compiles what the suite already holds."""
  cache = os.path.join(str(tmp_path), "home", ".cache")
  os.makedirs(cache, exist_ok=True)
  os.makedirs(CACHE_DIR, exist_ok=True)
  link = os.path.join(cache, "maxtext_jax")
  if not os.path.islink(link):
    os.symlink(CACHE_DIR, link)
  return os.path.dirname(cache)

import json  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_compilation_cache_dir", CACHE_DIR)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
BASE_YML = os.path.join(ROOT, "configs", "base.yml")

# A model small enough that a step takes milliseconds on a CPU.
TINY = ["emb_dim=64", "num_decoder_layers=2", "num_query_heads=4", "num_kv_heads=2", "head_dim=16",
        "mlp_dim=128", "vocab_size=264", "max_target_length=64", "per_device_batch_size=8",
        "steps=10", "warmup_steps=2", "log_period=5", "enable_tensorboard=false",
        "peak_tflops_per_device=1.0", "sample_at_end=false", f"jax_cache_dir={CACHE_DIR}",
        # fp32 compute: the tests' exact comparisons (1 vs 8 devices, resume, Hugging Face parity);
        # dtype=auto (bf16 when training) has its own tests in tests/test_auto_settings.py
        "dtype=float32"]
MESH_1 = ["ici_fsdp_parallelism=1"]
MESH_222 = ["per_device_batch_size=1", "ici_data_parallelism=2", "ici_fsdp_parallelism=2",
            "ici_tensor_parallelism=2"]


# Orbax-internal, not our restore path (tests/test_integrity.py's truncated file): when one shard
# read of a restore fails, orbax's asyncio_utils.run_sync closes its event loop with the sibling
# reads still pending (it avoids asyncio.run's task cancellation on purpose). Later, maybe in another
# test, TensorStore's completion callback finds the loop closed, and the garbage-collected
# `_read_array_index_and_device_put` coroutines turn the GeneratorExit into an Exception
# (`except BaseException`): both reach sys.unraisablehook. Only these two exact forms are ignored.
ORBAX_UNAWAITED_READS = (
    "ignore:Exception ignored in. <coroutine object _read_array_index_and_device_put"
    ":pytest.PytestUnraisableExceptionWarning",
    r"ignore:Exception ignored in. None[\s\S]*call_soon_threadsafe[\s\S]*Event loop is closed"
    ":pytest.PytestUnraisableExceptionWarning")


def pytest_configure(config):
  for spec in ORBAX_UNAWAITED_READS:
    config.addinivalue_line("filterwarnings", spec)
  config.addinivalue_line("markers", "tpu: runs on a TPU chip only (skipped elsewhere, e.g. in CI); "
                          "benchmarks/tpu_suite.sh runs them there in one process")


# The longest test files from an empty compilation cache (wall seconds per file, mostly CPU; a
# file that mostly waits, e.g. on Ray's start-up, goes early too, while the other worker computes:
# benchmarks/suite_profile.py), the longest first. pytest.ini's two workers take whole files in
# collection order (`--dist loadfile --no-loadscope-reorder`): these go first, so the run ends on
# small files and neither worker waits long for the other's last file. A file not listed runs
# after them, in its usual order.
COSTLIEST_FIRST = (
    "test_slots.py", "test_rl_ray.py", "test_context_parallel.py", "test_method_update.py",
    "test_grpo.py", "test_decode_unroll.py",
    "test_pipeline.py", "test_multiprocess.py", "test_inspect.py", "test_lora.py",
    "test_quant_moe.py", "test_faults.py", "test_hf_sharded_families.py",
    "test_quantize_recipe.py", "test_serve.py", "test_distill.py", "test_gemma4_sft_media.py",
    "test_inspect_backend.py", "test_hf_sharded.py", "test_decode_parity.py",
    "test_cpu_devices.py", "test_dpo.py", "test_moe.py", "test_rl_driver.py",
    "test_quantization.py", "test_loss_vocab_split.py", "test_qwen3_next_train.py",
    "test_gemma4_parity.py", "test_train.py", "test_bf16_weights.py", "test_rl_policy.py",
    "test_compile_counts.py",
    "test_loss.py", "test_qwen3_next_parity.py", "test_grpo_recipe.py",
    # then, by their tests over 8 s in a cold run of the suite (2026-12-06, `--durations`): the
    # rest came in name order, so a 25 s file (test_tpu_decode_script.py) could be a worker's last
    "test_lmeval.py", "test_object_store.py", "test_multimodal_inputs.py", "test_compile_cache.py",
    "test_memory.py", "test_mtp.py", "test_speculative.py", "test_tpu_decode_script.py",
    "test_lora_export.py", "test_gemma4_train.py", "test_serve_media.py", "test_rl_placement.py",
    "test_logit_check.py", "test_serve_docs.py", "test_sft_recipe.py")


def pytest_collection_modifyitems(session, config, items):
  del session, config
  rank = {name: i for i, name in enumerate(COSTLIEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: the rest keep order
  if any(item.get_closest_marker("tpu") for item in items) and jax.default_backend() != "tpu":
    skip = pytest.mark.skip(reason=f"needs a TPU chip (this backend: {jax.default_backend()}; "
                            "benchmarks/tpu_suite.sh runs these there)")
    for item in items:
      if item.get_closest_marker("tpu"):
        item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _absl_flags():
  from absl import flags
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


# Every compiled XLA:CPU program a process keeps holds ~3 memory maps per kernel (its object code,
# read-only data and data, as LLVM's JIT loads them), and Linux refuses a process's maps beyond
# vm.max_map_count (65530 by default). A worker runs hundreds of files, and jax keeps each jitted
# function's programs until its caches are cleared: kept, a run's workers reach the limit, and the
# JIT then crashes the worker (a segmentation fault in the next program's load). So each file's
# programs go when the file is done (the persistent cache keeps them for a later load), and a test
# that leaves its worker near the limit fails, naming the count, rather than a later one crashing.
# Counting the maps costs the kernel ~1 ms per thousand of them, after each test: while the last
# count was under a third of the limit only every fourth test is counted (a test adds a few
# thousand maps at most: four cannot take a worker from there past the share), and every file
# when it ends.
MAP_LIMIT_SHARE = 0.75
_maps = {"last": 0, "tests": 0}


def memory_maps() -> int:
  """This process's memory maps (the lines of /proc/self/maps; 0 where there is no such file)."""
  try:
    with open("/proc/self/maps", "rb") as f:
      return sum(1 for _ in f)
  except OSError:
    return 0


def map_limit() -> int:
  try:
    with open("/proc/sys/vm/max_map_count", encoding="utf-8") as f:
      return int(f.read())
  except OSError:
    return 0


# Python's cyclic collector walks every object it tracks on each full collection, and a test
# process holds millions (jax, flax, torch, transformers and the tests' own modules) while tracing
# allocates fast enough to trigger many collections. What is alive when a file begins is frozen
# out of the collector (`gc.freeze`; its garbage collected first), so a collection walks only the
# objects made since; freed by reference counting as ever, they are only never walked for cycles.
# The young generation's threshold is raised from 700 allocations to 100,000: tracing allocates
# millions of short-lived objects, nearly all freed by reference counting, and the older
# generations keep their ratios (every 10 collections of the one below), so the collector runs
# far less often for the same garbage. Each file still begins with a full collection.
def _collect_and_freeze():
  import gc
  gc.collect()
  gc.freeze()
  gc.set_threshold(100_000, 10, 10)


def _check_maps(what: str) -> None:
  limit, maps = map_limit(), memory_maps()
  _maps["last"] = maps
  if limit and maps > MAP_LIMIT_SHARE * limit:
    pytest.fail(f"{what} leaves its process with {maps} memory maps, over "
                f"{MAP_LIMIT_SHARE:.0%} of vm.max_map_count ({limit}): its file keeps too many "
                "compiled programs alive (each holds ~3 maps per kernel)", pytrace=False)


@pytest.fixture(scope="module", autouse=True)
def _release_programs(request):
  _collect_and_freeze()
  yield
  try:
    _check_maps(request.node.nodeid)
  finally:   # a file over the share still releases its programs
    jax.clear_caches()
    _collect_and_freeze()


@pytest.fixture(autouse=True)
def _maps_below_limit(request):
  yield
  _maps["tests"] += 1
  if _maps["tests"] % 4 == 0 or _maps["last"] > map_limit() / 3:
    _check_maps(request.node.nodeid)


@pytest.fixture
def users_emitters(monkeypatch):
  """The trainer's step compiled with the users' fusion emitters (USERS_EMITTERS), for a test
  whose two runs must agree bit for bit as they do at the users' compile."""
  from MaxText.runtime import cpu_devices
  options = cpu_devices.step_compiler_options
  monkeypatch.setattr(cpu_devices, "step_compiler_options",
                      lambda *a, **k: {**options(*a, **k), **USERS_EMITTERS})


def read_metrics(run_dir: str) -> list[dict]:
  with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def argv(out_dir, run_name: str, *overrides: str, config: str = BASE_YML,
         model: Sequence[str] = TINY) -> list[str]:
  """config + model + run location + overrides, a later value of a key replacing an earlier one
  (one `key=value` each on the command line)."""
  merged = dict(item.split("=", 1) for item in [*model, f"base_output_directory={out_dir}",
                                                f"run_name={run_name}", *overrides])
  return [config, *(f"{k}={v}" for k, v in merged.items())]


def train(out_dir, run_name: str, *overrides: str, devices=None):
  """Runs the trainer in this process; returns (exit code, metrics.jsonl rows, final state)."""
  from MaxText.train.loop import run
  code, trainer = run(argv(out_dir, run_name, *overrides), devices=devices)
  run_dir = os.path.join(str(out_dir), run_name)
  metrics = read_metrics(run_dir) if os.path.exists(os.path.join(run_dir, "metrics.jsonl")) else []
  return code, metrics, (trainer.final_state if trainer is not None else None)
