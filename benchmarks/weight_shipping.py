"""The weight shipping of rollout_placement=separate, side by side in one process: the trainer's
parameters (fp32, on the first half of the CPU devices) to the engine's devices (the second half)
by the refit stream, received tensor by tensor (`refit.Receiver`, what MaxText/rl/placement.py
does) and, for comparison, put together on the host first (every Hugging Face tensor in one dict,
`hf_to_params`, one `device_put`: what placement.py did before). Per model: the median wall and
CPU seconds of a shipment (interleaved repetitions after one warm-up each), and the peak host
bytes held during one (tracemalloc: NumPy's buffers are traced; the CPU devices' are not).

    .venv/bin/python benchmarks/weight_shipping.py [--reps 5]
    .venv/bin/python benchmarks/weight_shipping.py --ray [--reps 5]

`--ray`: across processes instead — a RayPolicy of 2 workers x 2 fake devices (the toy model)
ships to a RayEngine actor on 2 devices of its own (`ship_weights`: worker 0 → engine through
Ray's object store, tensor by tensor); the median seconds of a shipment after one warm-up.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import tracemalloc

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402

from MaxText import refit  # noqa: E402
from MaxText.config.load import load_config  # noqa: E402
from MaxText.models.model_config import ModelConfig  # noqa: E402
from MaxText.models.registry import get_hf_map, hf_model_type_for, init_params, make_model_def  # noqa: E402
from MaxText.sharding.mesh import create_mesh  # noqa: E402
from MaxText.sharding.rules import parse_rules, tree_shardings  # noqa: E402

BASE = os.path.join(ROOT, "configs", "base.yml")
MODELS = {   # the toy task's model (benchmarks/RESULTS.md, rollout placement), and a wider one
    "toy (emb 128, 2 layers)": ["emb_dim=128", "num_decoder_layers=2", "num_query_heads=4",
                                "num_kv_heads=2", "head_dim=32", "mlp_dim=256",
                                "vocab_size=264"],
    "emb 512, 8 layers": ["emb_dim=512", "num_decoder_layers=8", "num_query_heads=8",
                          "num_kv_heads=4", "head_dim=64", "mlp_dim=1536", "vocab_size=8192"],
}


def across_processes(reps: int) -> None:
  import tempfile  # pylint: disable=import-outside-toplevel
  import ray  # pylint: disable=import-outside-toplevel
  from MaxText.rl.ray_policy import RayEngine, RayPolicy  # pylint: disable=import-outside-toplevel
  out = tempfile.mkdtemp()
  config = [os.path.join(ROOT, "configs", "grpo.yml"), *MODELS["toy (emb 128, 2 layers)"],
            "dtype=float32", "max_target_length=16", f"base_output_directory={out}",
            "run_name=ship", "enable_tensorboard=false", "enable_checkpointing=false"]
  ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
           runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
  group = RayPolicy.start(num_workers=2, devices_per_worker=2, config=config)
  engine = RayEngine.start(devices=2, config=config, batch_size=8, max_cache_length=16)
  try:
    group.ship_weights(engine)   # warm-up: compiles
    times = [group.ship_weights(engine) for _ in range(reps)]
    print(f"toy model, 2 workers x 2 devices -> engine actor on 2: ship_weights median "
          f"{statistics.median(times) * 1e3:.1f} ms (min {min(times) * 1e3:.1f})")
  finally:
    engine.kill()
    group.close()
    ray.shutdown()


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--ray", action="store_true")
  args = ap.parse_args()
  if args.ray:
    across_processes(args.reps)
    return 0
  devices = jax.devices()
  for label, keys in MODELS.items():
    cfg = load_config([BASE, *keys, "dtype=float32", "weight_dtype=float32"])
    mcfg = ModelConfig.from_config(cfg)
    md = make_model_def(mcfg)
    def shardings(devs):
      mesh = create_mesh(cfg, devs)
      return tree_shardings(md.logical_axes, md.abstract_params, mesh,
                            parse_rules(cfg.logical_axis_rules, mesh.axis_names))
    train, engine = shardings(devices[:2]), shardings(devices[2:])
    params = jax.device_put(init_params(mcfg, 0), train)
    model_type = hf_model_type_for(mcfg, cfg.hf_model_type)
    receiver = refit.Receiver(mcfg, engine, model_type)
    hf_map = get_hf_map(model_type)
    shipped = {"stream": None}

    def by_stream():
      shipped["stream"] = jax.block_until_ready(
          receiver.load(refit.stream(params, cfg), shipped["stream"]))

    def whole_on_host():
      shipped["host"] = None
      hf = dict(refit.stream(params, cfg))
      shipped["host"] = jax.block_until_ready(jax.device_put(hf_map.hf_to_params(hf, mcfg),
                                                             engine))

    ways = {"stream, tensor by tensor (Receiver)": by_stream,
            "whole model on the host (before)": whole_on_host}
    times = {k: ([], []) for k in ways}
    peaks = {}
    for name, fn in ways.items():
      fn()                              # warm-up: compiles
      tracemalloc.start()
      fn()
      peaks[name] = tracemalloc.get_traced_memory()[1]
      tracemalloc.stop()
    for _ in range(args.reps):
      for name, fn in ways.items():
        w, c = time.perf_counter(), time.process_time()
        fn()
        times[name][0].append(time.perf_counter() - w)
        times[name][1].append(time.process_time() - c)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
    print(f"{label}: {nbytes / 2**20:.2f} MiB of fp32 parameters")
    for name in ways:
      wall, cpu = (statistics.median(v) for v in times[name])
      print(f"  {name}: {wall * 1e3:.1f} ms wall, {cpu * 1e3:.1f} ms CPU, "
            f"peak host {peaks[name] / 2**20:.2f} MiB")
  return 0


if __name__ == "__main__":
  sys.exit(main())
