"""Where the train step's time goes: runs our step of the reference tiny config (the one of
`tiny_train.py`) on N fake CPU devices under `jax.profiler` with XLA:CPU's per-op trace events
(`--xla_cpu_enable_xprof_traceme=true`), then prints the ops' time per step, largest first, each
with its output shape and the jax operations fused into it (from the compiled HLO's metadata).

  .venv/bin/python benchmarks/profile_step.py [--devices 1] [--dtype bfloat16] [--top 40] [key=value ...]

Times are summed over every device's ops (an op inside the layer scan counts all its layers), so
their total exceeds the wall time when the devices or XLA's threads run in parallel. On a busy
machine they stretch, but their shares stay meaningful.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
STEPS = 3
# trace events that contain other ops, or are waits rather than work
WRAPPERS = ("ThunkExecutor", "$", "end:", "while", "PjitFunction", "CommonPjRt", "Wait",
            "Rendezvous")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def op_times(trace_dir: str) -> tuple[collections.Counter, float]:
  """(op name → seconds per step, seconds per step the devices waited for each other at
  collectives), from the perfetto trace the profiler wrote."""
  path = sorted(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True))[-1]
  events = json.load(gzip.open(path))
  events = events["traceEvents"] if isinstance(events, dict) else events
  times, waited = collections.Counter(), 0.0
  for e in events:
    if e.get("ph") != "X" or "dur" not in e:
      continue
    if e["name"].startswith("Rendezvous"):
      waited += e["dur"] / 1e6 / STEPS
    elif not e["name"].startswith(WRAPPERS) and "Await" not in e["name"]:
      times[e["name"]] += e["dur"] / 1e6 / STEPS
  return times, waited


def describe(hlo: str) -> dict[str, tuple[str, str]]:
  """instruction name → (its output shape, the jax operations fused into it)."""
  bodies = {m.group(1): m.group(2)
            for m in re.finditer(r"^%?([\w.\-]+) \(.*?\{\n(.*?)\n\}", hlo, re.M | re.S)}
  out = {}
  for m in re.finditer(r"^\s*%?([\w.\-]+) = (\S+) [\w\-]+\((.*)$", hlo, re.M):
    called = re.search(r"calls=%?([\w.\-]+)", m.group(0))
    body = bodies.get(called.group(1), "") if called else m.group(0)
    ops = collections.Counter(x.split("/")[-1] for x in re.findall(r'op_name="([^"]+)"', body))
    out[m.group(1)] = (m.group(2), ",".join(k for k, _ in ops.most_common(6)))
  return out


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--devices", type=int, default=1)
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--top", type=int, default=40)
  ap.add_argument("overrides", nargs="*", help="extra key=value config overrides")
  args = ap.parse_args()
  n = args.devices
  os.environ["XLA_FLAGS"] = (f"--xla_force_host_platform_device_count={n} "
                             "--xla_cpu_enable_xprof_traceme=true")
  os.environ["JAX_PLATFORMS"] = "cpu"

  import jax

  from MaxText.config.load import load_config
  from MaxText.train.loop import Trainer
  from MaxText.train.state import init_state
  from ab_step import synthetic_batch
  from tiny_train import GLOBAL_BATCH, REF

  work = tempfile.mkdtemp(prefix="profile_step_")
  keys = [f"{k}={v}" for k, v in REF.items()] + [
      f"per_device_batch_size={GLOBAL_BATCH / n:g}", "dataset_type=synthetic", f"dtype={args.dtype}",
      "jax_cache_dir=", f"ici_fsdp_parallelism={n}", f"base_output_directory={work}",
      "run_name=profile", *args.overrides]
  trainer = Trainer(load_config([os.path.join(ROOT, "configs/base.yml"), *keys]))
  compiled = trainer.compile_step()
  state = init_state(trainer.mcfg, 0, trainer.tx, trainer.shardings)
  batch = synthetic_batch(trainer)
  for _ in range(STEPS):   # warm-up
    state, metrics = compiled(state, batch)
  jax.block_until_ready(metrics)
  jax.profiler.start_trace(work, create_perfetto_trace=True)
  t0 = time.perf_counter()
  for _ in range(STEPS):
    state, metrics = compiled(state, batch)
  jax.block_until_ready(metrics)
  wall = (time.perf_counter() - t0) / STEPS
  jax.profiler.stop_trace()

  (times, waited), shapes = op_times(work), describe(compiled.as_text())
  total = sum(times.values())
  collective = sum(s for name, s in times.items() if name.startswith(COLLECTIVES))
  print(f"{n} device(s), {args.dtype}: {wall:.3f} s wall per step, {total:.3f} s of op time per "
        f"step, of which collectives {collective:.3f} s; {waited:.3f} s waiting at collectives' "
        f"rendezvous (load average {os.getloadavg()[0]:.2f})")
  print("| s per step | share | op | output | fused jax operations |\n|---|---|---|---|---|")
  for name, s in times.most_common(args.top):
    shape, ops = shapes.get(name, ("?", ""))
    print(f"| {s:.4f} | {100 * s / total:.1f} % | {name} | `{shape}` | {ops[:90]} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
