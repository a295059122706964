"""Pipeline parallelism on fake CPU devices: the trainer's compiled step at 1, 2 and 4 stages (the
rest of the devices fsdp) and several microbatch counts, with each schedule's bubble fraction.

  .venv/bin/python benchmarks/pipeline.py [--devices 8] [--layers 8] [--batch 16] [--seq 128]
      [--configs 1x1,2x2,2x4,2x8,4x4,4x8] [--rounds 3] [--out FILE]

`--configs`: stages x microbatches (1x1: no pipeline, fsdp over all devices); `SxMxR` adds R
circular repeats. A dense llama-style model (D 64, 4/2 heads of 16, MLP 128, `--layers` layers,
fp32, dot-product attention, remat save_matmuls), `--batch` rows of `--seq` tokens per step (the
same global batch for every row). Every configuration is compiled once, then `--rounds` rounds run
each configuration's step once, alternating, so that load on a shared machine hits all alike. The
table gives the bubble fraction (S - 1) / (M x R + S - 1), the median step time (wall) and CPU
seconds per step (the process's, all threads), and the compiled step's temp memory per device
(`memory_analysis()`). Fake CPU devices share the host's cores, so a stage does not run beside
the others as on real chips: the figures show the schedule's overhead (the bubble's iterations
are computed and dropped in this SPMD form, the stage shifts are copies), not a speed-up.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODEL = ["vocab_size=264", "emb_dim=64", "num_query_heads=4", "num_kv_heads=2", "head_dim=16",
         "mlp_dim=128", "attention=dot_product", "dataset_type=synthetic", "dtype=float32",
         "enable_tensorboard=false", "enable_checkpointing=false", "jax_cache_dir="]


def uptime() -> str:
  try:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
  except OSError:
    return "uptime unavailable"


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--devices", type=int, default=8)
  ap.add_argument("--layers", type=int, default=8)
  ap.add_argument("--batch", type=int, default=16)
  ap.add_argument("--seq", type=int, default=128)
  ap.add_argument("--configs", default="1x1,2x2,2x4,2x8,4x4,4x8")
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--out", default="")
  args = ap.parse_args()
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={args.devices}").strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

  import jax
  import numpy as np

  from MaxText.config.load import load_config
  from MaxText.data.batch import BATCH_KEYS
  from MaxText.train.loop import Trainer
  from MaxText.train.state import init_state

  base = os.path.join(ROOT, "configs", "base.yml")
  devices = jax.devices()[:args.devices]

  def build(spec: str):
    S, M, R = ([int(x) for x in spec.split("x")] + [1])[:3]
    cfg = load_config([base, *MODEL, f"num_decoder_layers={args.layers}",
                       f"max_target_length={args.seq}",
                       f"per_device_batch_size={args.batch / args.devices}",
                       f"ici_pipeline_parallelism={S}", "ici_fsdp_parallelism=-1",
                       f"num_pipeline_microbatches={M if S > 1 else 0}",
                       f"num_pipeline_repeats={R}"])
    t = Trainer(cfg, devices)
    t0 = time.perf_counter()
    compiled = t.compile_step()
    compile_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (args.batch, args.seq)).astype(np.int32)
    host = {"inputs": tokens, "targets": np.roll(tokens, -1, 1),
            "inputs_position": np.tile(np.arange(args.seq, dtype=np.int32), (args.batch, 1)),
            "inputs_segmentation": np.ones((args.batch, args.seq), np.int32),
            "targets_segmentation": np.ones((args.batch, args.seq), np.int32)}
    batch = {k: jax.device_put(host[k], t.batch_sharding) for k in BATCH_KEYS}
    label = "no pipeline" if t.schedule is None else (
        f"{S} stages x {M} microbatches" + (f" x {R} repeats" if R > 1 else ""))
    print(f"compiled {label} in {compile_s:.1f} s", file=sys.stderr, flush=True)
    return {"label": label, "mesh": dict(t.mesh.shape), "trainer": t, "compiled": compiled,
            "batch": batch, "state": init_state(t.mcfg, 0, t.tx, t.shardings),
            "bubble": 0.0 if t.schedule is None else t.schedule.bubble_fraction,
            "temp": compiled.memory_analysis().temp_size_in_bytes, "wall": [], "cpu": [],
            "loss": None}

  def step(run, timed=True):
    w0, c0 = time.perf_counter(), time.process_time()
    run["state"], metrics = run["compiled"](run["state"], run["batch"])
    jax.block_until_ready(metrics["loss"])
    if timed:
      run["wall"].append(time.perf_counter() - w0)
      run["cpu"].append(time.process_time() - c0)
    if run["loss"] is None:
      run["loss"] = float(metrics["loss"])

  load_before = uptime()
  runs = [build(s) for s in args.configs.split(",") if s]
  for run in runs:
    step(run, timed=False)
  for _ in range(args.rounds):
    for run in runs:
      step(run)
  load_after = uptime()
  fsdp = lambda r: r["mesh"]["fsdp"]
  lines = [f"{devices[0].platform}, {len(devices)} fake devices, jax {jax.__version__}; llama-style "
           f"D 64, {args.layers} layers, batch {args.batch} x {args.seq} tokens, fp32; one "
           f"training step (fwd + bwd + AdamW), median of {args.rounds} alternating rounds",
           f"load before: {load_before}", f"load after:  {load_after}", "",
           "| schedule | stage x fsdp | bubble | step ms | CPU-s / step | temp MiB / device | "
           "first loss |", "|---|---|---|---|---|---|---|"]
  for r in runs:
    lines.append(f"| {r['label']} | {r['mesh']['stage']} x {fsdp(r)} | {r['bubble']:.3f} | "
                 f"{statistics.median(r['wall']) * 1e3:,.0f} | {statistics.median(r['cpu']):.2f} "
                 f"| {r['temp'] / 2**20:,.1f} | {r['loss']:.6f} |")
  text = "\n".join(lines)
  print(text)
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      f.write(text + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
