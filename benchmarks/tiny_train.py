"""Trains the reference tiny config with this trainer and (optionally) with MaxText, side by side.

Reference config: d_model 256, 4 layers, 4 heads of 64, SwiGLU mlp 1024, vocab 8192, seq 256,
global batch 8, synthetic data, 1 device; fp32 and bf16 compute (fp32 master weights).

For each dtype it runs, interleaved so that machine noise hits all alike:
  ours-default   this trainer with its own default remat/scan settings
  ours-as-mt     this trainer with MaxText's defaults (remat_policy=full, scan_layers=true)
  maxtext        MaxText with its defaults (needs --maxtext-python; see benchmarks/RESULTS.md)
and prints tokens/s (median of steps 5..N), step time, cold compile time, MFU and peak RSS.

  .venv/bin/python benchmarks/tiny_train.py --maxtext-python /path/to/maxtext-venv/bin/python
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REF = {"emb_dim": 256, "num_decoder_layers": 4, "num_query_heads": 4, "num_kv_heads": 4,
       "head_dim": 64, "mlp_dim": 1024, "vocab_size": 8192, "max_target_length": 256}


def ours_cmd(out: str, name: str, dtype: str, steps: int, extra: list[str]) -> list[str]:
  keys = [f"{k}={v}" for k, v in REF.items()] + [
      "per_device_batch_size=8", "ici_fsdp_parallelism=1", "dataset_type=synthetic",
      f"steps={steps}", "enable_checkpointing=false", "enable_tensorboard=false", "jax_cache_dir=",
      f"dtype={dtype}", "weight_dtype=float32", f"base_output_directory={out}", f"run_name={name}"]
  return [sys.executable, os.path.join(ROOT, "train.py"), os.path.join(ROOT, "configs/base.yml"),
          *keys, *extra]


def maxtext_cmd(python: str, out: str, name: str, dtype: str, steps: int) -> list[str]:
  site = subprocess.run([python, "-c", "import maxtext, os; print(os.path.dirname(maxtext.__file__))"],
                        capture_output=True, text=True, check=True).stdout.strip()
  run_dir = os.path.join(out, name)
  os.makedirs(run_dir, exist_ok=True)
  return [python, "-m", "maxtext.trainers.pre_train.train", os.path.join(site, "configs/base.yml"),
          "run_name=mt", f"base_output_directory={run_dir}", "hardware=cpu",
          "skip_jax_distributed_system=true", "dataset_type=synthetic", "packing=false",
          f"steps={steps}", "enable_checkpointing=false", "attention=dot_product", "jax_cache_dir=",
          f"metrics_file={run_dir}/metrics.jsonl", "enable_tensorboard=false", "model_name=default",
          "decoder_block=llama2", "base_emb_dim=256", "base_num_decoder_layers=4",
          "base_num_query_heads=4", "base_num_kv_heads=4", "head_dim=64", "base_mlp_dim=1024",
          'mlp_activations=["silu","linear"]', "vocab_size=8192", "max_target_length=256",
          "per_device_batch_size=8", f"dtype={dtype}", "weight_dtype=float32"]


def run(cmd: list[str], env: dict, log_path: str) -> tuple[int, float, float]:
  """Runs cmd; returns (exit status, peak RSS in GiB of that process, wall seconds)."""
  start = time.perf_counter()
  with open(log_path, "w") as log:
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    _, status, usage = os.wait4(proc.pid, 0)
  return os.waitstatus_to_exitcode(status), usage.ru_maxrss / 2**20, time.perf_counter() - start


def summarise(kind: str, run_dir: str, log_path: str, first: int) -> dict:
  rows = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl")) if l.strip()]
  log = open(log_path).read()
  if kind == "maxtext":
    tok = [r["perf/per_device_tokens_per_sec"] for r in rows if r["step"] >= first]
    step_s = [r["perf/step_time_seconds"] for r in rows if r["step"] >= first]
    tflops = [r["perf/per_device_tflops_per_sec"] for r in rows if r["step"] >= first]
    return {"tokens_per_s": statistics.median(tok), "step_s": statistics.median(step_s),
            "tflops": statistics.median(tflops), "mfu": None, "compile_s": None,
            "steps_total_s": sum(r["perf/step_time_seconds"] for r in rows)}
  sel = [r for r in rows if r["step"] > first]  # our steps count from 1
  m = re.search(r"compiled the train step in ([\d.]+) s", log)
  return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in sel),
          "step_s": statistics.median(r["step_time_s"] for r in sel),
          "tflops": statistics.median(r["tflops_per_device"] for r in sel),
          "mfu": statistics.median(r["mfu"] for r in sel),
          "compile_s": float(m.group(1)) if m else None,
          "steps_total_s": sum(r["step_time_s"] for r in rows)}


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--maxtext-python", default="", help="python of a venv with maxtext installed")
  ap.add_argument("--dtypes", default="float32,bfloat16")
  ap.add_argument("--steps", type=int, default=21)
  ap.add_argument("--first-step", type=int, default=5, help="median over steps >= this")
  ap.add_argument("--repeats", type=int, default=1, help="interleaved repetitions of every run")
  ap.add_argument("--out", default="", help="work directory (default: a temporary one)")
  args = ap.parse_args()
  out = os.path.abspath(args.out) if args.out else tempfile.mkdtemp(prefix="tiny_train_")
  os.makedirs(out, exist_ok=True)
  env = dict(os.environ, JAX_PLATFORMS="cpu", DECOUPLE_GCLOUD="TRUE")
  env.pop("XLA_FLAGS", None)
  results: dict[tuple[str, str], list[dict]] = {}
  for rep in range(args.repeats):
    for dtype in args.dtypes.split(","):
      runs = [("ours-default", f"d-{dtype}-{rep}", []),
              ("ours-as-mt", f"m-{dtype}-{rep}", ["remat_policy=full", "scan_layers=true"])]
      if args.maxtext_python:
        runs.append(("maxtext", f"mt-{dtype}-{rep}", None))
      for kind, name, extra in runs:
        run_dir = os.path.join(out, name)
        cmd = (maxtext_cmd(args.maxtext_python, out, name, dtype, args.steps) if kind == "maxtext"
               else ours_cmd(out, name, dtype, args.steps, extra))
        log_path = os.path.join(out, f"{kind}-{dtype}-{rep}.log")
        code, rss, wall = run(cmd, env, log_path)
        if code != 0:
          print(f"{kind} {dtype}: exit {code}; see {log_path}", file=sys.stderr)
          return 1
        s = summarise(kind, run_dir, log_path, args.first_step)
        s["rss_gib"] = rss
        s["overhead_s"] = wall - s["steps_total_s"]  # start-up, config, compile, teardown
        results.setdefault((kind, dtype), []).append(s)
        print(f"  {kind:13s} {dtype:9s} {s['tokens_per_s']:8,.0f} tok/s", flush=True)

  print(f"\n| run | dtype | tokens/s | step s | compile s | wall outside steps s | TFLOP/s | MFU | "
        f"peak RSS GiB |")
  print("|---|---|---|---|---|---|---|---|---|")
  for (kind, dtype), rs in results.items():
    med = lambda k: statistics.median(r[k] for r in rs) if all(r[k] is not None for r in rs) else None
    fmt = lambda v, f: format(v, f) if v is not None else "n/a"
    print(f"| {kind} | {dtype} | {med('tokens_per_s'):,.0f} | {med('step_s'):.3f} | "
          f"{fmt(med('compile_s'), '.1f')} | {med('overhead_s'):.1f} | {med('tflops'):.4f} | "
          f"{fmt(med('mfu') and 100 * med('mfu'), '.1f')}{'%' if med('mfu') else ''} | "
          f"{med('rss_gib'):.2f} |")
  if args.maxtext_python:
    print()
    for dtype in args.dtypes.split(","):
      mt = statistics.median(r["tokens_per_s"] for r in results[("maxtext", dtype)])
      for kind in ("ours-default", "ours-as-mt"):
        ours = statistics.median(r["tokens_per_s"] for r in results[(kind, dtype)])
        print(f"{kind} / maxtext ({dtype}): {ours / mt:.2f}x")
  return 0


if __name__ == "__main__":
  sys.exit(main())
