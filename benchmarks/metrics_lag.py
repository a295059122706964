"""Reading each step's metrics one step late (the loop: step N+1 is dispatched before step N's
metrics are read back) vs at once (each step waited for as soon as it is dispatched: a host sync
per step, as the former loop's read before the next dispatch): the whole training loop
(`Trainer.run`, synthetic data, no checkpoints), both kinds alternated in ONE process, `--pairs`
times, so a shared machine's load hits both alike. The compute dtype is printed (the default:
dtype=auto, bf16; `dtype=float32` as an override for fp32).

  .venv/bin/python benchmarks/metrics_lag.py [--devices 8] [--pairs 4] [--steps 12] [key=value ...]

Model: tiny_train.py's reference config (vocab 8192, global batch 8) on data 2 x fsdp devices/2.
Per run: median wall seconds per step (the loop's own step_time_s, steps >= 3), and CPU seconds
per step (the process's CPU time between consecutive metrics rows). The late reading can only
save wall time (the host's work per step, overlapped with the device's); CPU per step shows that
the work is the same.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
FIRST = 3   # steps before this one are warm-up


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--devices", type=int, default=8)
  ap.add_argument("--pairs", type=int, default=4)
  ap.add_argument("--steps", type=int, default=12)
  ap.add_argument("overrides", nargs="*", help="extra key=value config overrides")
  args = ap.parse_args()
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
  os.environ["JAX_PLATFORMS"] = "cpu"

  import jax  # pylint: disable=import-outside-toplevel
  from MaxText.train.loop import Trainer, run  # pylint: disable=import-outside-toplevel
  from tiny_train import GLOBAL_BATCH, REF, mesh_keys  # pylint: disable=import-outside-toplevel

  class Timed(Trainer):
    """The loop as it is, with the process's CPU time taken at each metrics row."""

    def __init__(self, *a, **kw):
      super().__init__(*a, **kw)
      self.cpu_at_rows: list[float] = []

    def loop_parts(self, *a):
      parts = super().loop_parts(*a)
      read = parts.rows.row

      def row(metrics):
        out = read(metrics)
        self.cpu_at_rows.append(time.process_time())
        return out
      parts.rows.row = row
      return parts

  class AtOnce(Timed):
    """Each step waited for as soon as it is dispatched: the host's per-step work (the metrics
    row, the next batch's transfer) no longer overlaps the device's step."""

    def compile_step(self):
      compiled = super().compile_step()
      return lambda state, batch: jax.block_until_ready(compiled(state, batch))

  work = tempfile.mkdtemp(prefix="metrics_lag_")
  n = args.devices
  keys = [f"{k}={v}" for k, v in REF.items()] + [
      f"per_device_batch_size={GLOBAL_BATCH / n:g}", "dataset_type=synthetic",
      f"steps={args.steps}", "enable_checkpointing=false", "enable_tensorboard=false",
      "sample_at_end=false", f"jax_cache_dir={work}/jax_cache", f"base_output_directory={work}",
      *(f"{k}={v}" for k, v in mesh_keys(n, "data").items()), *args.overrides]
  results: dict[str, list[tuple[float, float]]] = {"late": [], "at once": []}
  load0 = os.getloadavg()[0]
  for pair in range(args.pairs + 1):   # pair 0 fills the compilation cache; not counted
    for name, cls in (("late", Timed), ("at once", AtOnce)):
      code, trainer = run([os.path.join(ROOT, "configs/base.yml"), *keys,
                           f"run_name={name.replace(' ', '_')}-{pair}"], trainer_class=cls)
      if code != 0:
        print(f"{name}: exit {code}", file=sys.stderr)
        return 1
      rows = [json.loads(l) for l in open(os.path.join(trainer.run_dir, "metrics.jsonl"))]
      wall = statistics.median(r["step_time_s"] for r in rows if r["step"] >= FIRST)
      cpu = trainer.cpu_at_rows
      cpu_step = (cpu[-1] - cpu[FIRST - 1]) / (len(cpu) - FIRST)
      if pair:
        results[name].append((wall, cpu_step))
  print(f"\n{n} fake devices (data 2 x fsdp {n // 2}), tiny config ({' '.join(args.overrides)}); "
        f"compute {trainer.cfg.dtype}, weights {trainer.cfg.weight_dtype}, loss chunk "
        f"{trainer.cfg.loss_chunk_length or 'none'}; "
        f"{args.pairs} pairs x {args.steps} steps; load average {load0:.2f} -> "
        f"{os.getloadavg()[0]:.2f}\n")
  print("| metrics read | wall s per step (median of runs) | each run | CPU-s per step |")
  print("|---|---|---|---|")
  for name, rs in results.items():
    print(f"| {name} | {statistics.median(w for w, _ in rs):.3f} | "
          f"{', '.join(f'{w:.3f}' for w, _ in rs)} | {statistics.median(c for _, c in rs):.3f} |")
  ratios = [b[0] / a[0] for a, b in zip(results["late"], results["at once"])]
  print(f"\nat once / late, wall per step, pair by pair: {', '.join(f'{r:.3f}' for r in ratios)}"
        f" (median {statistics.median(ratios):.3f})")
  return 0


if __name__ == "__main__":
  sys.exit(main())
