"""One row of the TPU lane's side-by-side table: our trainer (`train.py`) or MaxText 0.2.5 (the
arm installed by benchmarks/tpu_install.sh) trained on synthetic data for a few steps in a
subprocess, its per-step metrics file read back, and one JSON record printed:

  python3 benchmarks/tpu_rows.py ours    [--steps 12] [--warmup 5] [--peak-tflops 197] key=value ...
  python3 benchmarks/tpu_rows.py maxtext [--steps 12] ... key=value ...   # = benchmarks/maxtext_arm.py
  from benchmarks.tpu_rows import ours_row, maxtext_row                   # the same, as functions

key=value are the row's config keys, in each trainer's own names (ours: configs/base.yml; MaxText:
its base.yml, e.g. `base_num_decoder_layers`, which needs `override_model_config=true` to change
a model file's value); they win over the defaults below. Every run is cold (`jax_cache_dir=`),
without checkpoints, in a fresh temporary directory (--work DIR keeps it, with the run's log).

  ours:    python train.py configs/base.yml dataset_type=synthetic steps=N enable_checkpointing=false
           sample_at_end=false enable_tensorboard=false jax_cache_dir= base_output_directory=WORK
           run_name=ours ...            -> WORK/ours/metrics.jsonl (steps 1-based)
  maxtext: DECOUPLE_GCLOUD=TRUE PYTHONPATH=$MAXTEXT_ARM_PYTHONPATH python -m
           maxtext.trainers.pre_train.train <its package>/configs/base.yml dataset_type=synthetic
           steps=N enable_checkpointing=false skip_jax_distributed_system=true jax_cache_dir=
           enable_tensorboard=false base_output_directory=WORK run_name=maxtext
           metrics_file=WORK/maxtext_metrics.jsonl ...   (steps 0-based)

The record: medians over the steps after the first `warmup` ones (MaxText's steps >= warmup, ours
>= warmup + 1: the same steps of the run) of tokens/s per device, TFLOP/s per device, TFLOP per
step per device (each trainer's own count) and the step time; MFU = TFLOP/s per device / the
peak given (--peak-tflops, default 197: TPU v5e bf16; the same figure for both, so the two MFUs
compare; ours' own figure is `mfu_own`); the devices (from each run's log), seconds from launch to
the first step's end, the exit status, and on failure the log's tail. Exit status: the run's, or 1
when it left no step past the warm-up.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Iterable, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V5E_PEAK_TFLOPS = 197.0
TAIL_LINES = 40
ARM_PATH_ENV = "MAXTEXT_ARM_PYTHONPATH"
DEFAULT_ARM_PATH = "/tmp/site-maxtext:/tmp/site"   # benchmarks/tpu_install.sh's defaults


def merge_keys(defaults: dict[str, str], overrides: Sequence[str]) -> list[str]:
  """`key=value` arguments: the defaults, each replaced by an override of the same key (both
  trainers refuse or ignore a key given twice), then the other overrides in their order."""
  out = dict(defaults)
  for arg in overrides:
    key, eq, value = arg.partition("=")
    if not eq or not key:
      raise ValueError(f"'{arg}' is not key=value")
    out[key] = value
  return [f"{k}={v}" for k, v in out.items()]


def read_jsonl(path: str) -> list[dict[str, Any]]:
  """The rows of a metrics file; lines that are not JSON objects (a run killed mid-write) are
  skipped."""
  rows = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        row = json.loads(line)
      except ValueError:
        continue
      if isinstance(row, dict) and "step" in row:
        rows.append(row)
  return rows


def _median(rows: Iterable[dict[str, Any]], key: str) -> float | None:
  vals = [float(r[key]) for r in rows
          if isinstance(r.get(key), (int, float)) and math.isfinite(float(r[key]))]
  return statistics.median(vals) if vals else None


def summarize(rows: list[dict[str, Any]], *, trainer: str, warmup: int,
              peak_tflops: float) -> dict[str, Any]:
  """Medians of one run's metrics rows over its steps after the first `warmup` ones."""
  if trainer == "maxtext":   # 0-based steps; per-device figures
    first, tok, tfs, time_key = warmup, "perf/per_device_tokens_per_sec", \
        "perf/per_device_tflops_per_sec", "perf/step_time_seconds"
  elif trainer == "ours":    # 1-based steps; tokens_per_s is the global figure
    first, tok, tfs, time_key = warmup + 1, "tokens_per_s", "tflops_per_device", "step_time_s"
  else:
    raise ValueError(f"trainer must be 'ours' or 'maxtext', not {trainer!r}")
  used = [r for r in rows if isinstance(r.get("step"), (int, float)) and r["step"] >= first]
  rec: dict[str, Any] = {"steps_recorded": len(rows), "steps_used": len(used)}
  rec["step_time_s"] = _median(used, time_key)
  rec["tflops_per_s_per_device"] = _median(used, tfs)
  per_step = [dict(x=r[tfs] * r[time_key]) for r in used
              if isinstance(r.get(tfs), (int, float)) and isinstance(r.get(time_key), (int, float))]
  rec["tflop_per_step_per_device"] = _median(per_step, "x")
  rec["mfu"] = (rec["tflops_per_s_per_device"] / peak_tflops
                if rec["tflops_per_s_per_device"] is not None and peak_tflops > 0 else None)
  if trainer == "maxtext":
    rec["tokens_per_s_per_device"] = _median(used, tok)
  else:
    rec["tokens_per_s"] = _median(used, tok)
    rec["mfu_own"] = _median(used, "mfu")
  return rec


def _tail(path: str, n: int = TAIL_LINES) -> str:
  try:
    with open(path, encoding="utf-8", errors="replace") as f:
      return "".join(f.readlines()[-n:])
  except OSError:
    return ""


def _run(cmd: list[str], *, env: dict[str, str], cwd: str, log: str,
         timeout_s: float | None) -> tuple[int, float, float]:
  """Runs cmd with its output in `log`: (exit status, wall seconds, launch time as epoch s)."""
  start = time.time()
  with open(log, "w", encoding="utf-8") as out:
    try:
      rc = subprocess.run(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                          timeout=timeout_s, check=False).returncode
    except subprocess.TimeoutExpired:
      rc = 124
  return rc, time.time() - start, start


def _finish(rec: dict[str, Any], rc: int, log: str) -> dict[str, Any]:
  rec["exit_status"] = rc
  if rc != 0 or not rec.get("steps_used"):
    rec["log_tail"] = _tail(log)
  return rec


def _record(trainer: str, cmd: list[str], metrics: str, log: str, wall: float, *, warmup: int,
            peak_tflops: float) -> tuple[dict[str, Any], str]:
  """(the row's record from its metrics file, the run's whole log)."""
  rows = read_jsonl(metrics) if os.path.isfile(metrics) else []
  rec = {"trainer": trainer, "command": " ".join(cmd[1:]), "peak_tflops": peak_tflops,
         **summarize(rows, trainer=trainer, warmup=warmup, peak_tflops=peak_tflops),
         "wall_s": round(wall, 1)}
  return rec, _tail(log, 10**6)


class _Work:
  """The run's directory: the one given (kept), or a temporary one (removed)."""

  def __init__(self, path: str | None):
    self.keep = bool(path)
    self.path = os.path.abspath(path) if path else tempfile.mkdtemp(prefix="tpu_row.")
    os.makedirs(self.path, exist_ok=True)

  def __enter__(self) -> str:
    return self.path

  def __exit__(self, *exc: object) -> None:
    if not self.keep:
      shutil.rmtree(self.path, ignore_errors=True)


def ours_row(overrides: Sequence[str] = (), *, steps: int = 12, warmup: int = 5,
             peak_tflops: float = V5E_PEAK_TFLOPS, python: str = sys.executable,
             timeout_s: float | None = None, work: str | None = None) -> dict[str, Any]:
  """Our trainer's row (train.py in this checkout, the caller's PYTHONPATH)."""
  with _Work(work) as wd:
    keys = merge_keys({"dataset_type": "synthetic", "steps": str(steps),
                       "enable_checkpointing": "false", "sample_at_end": "false",
                       "enable_tensorboard": "false", "jax_cache_dir": "",
                       "base_output_directory": wd, "run_name": "ours"}, overrides)
    cmd = [python, "train.py", "configs/base.yml", *keys]
    log = os.path.join(wd, "ours.log")
    rc, wall, _ = _run(cmd, env=dict(os.environ), cwd=ROOT, log=log, timeout_s=timeout_s)
    out_dir = dict(k.split("=", 1) for k in keys)
    metrics = os.path.join(out_dir["base_output_directory"], out_dir["run_name"], "metrics.jsonl")
    rec, text = _record("ours", cmd, metrics, log, wall, warmup=warmup, peak_tflops=peak_tflops)
    m = re.search(r" over (\d+) \S+ devices", text)
    rec["devices"] = int(m.group(1)) if m else None
    if rec["devices"] and rec.get("tokens_per_s") is not None:
      rec["tokens_per_s_per_device"] = rec["tokens_per_s"] / rec["devices"]
    m = re.search(r"start-up ([\d.]+) s to the first step", text)
    rec["first_step_s"] = float(m.group(1)) if m else None
    return _finish(rec, rc, log)


def arm_package(pythonpath: str) -> str:
  """The installed maxtext package directory on the arm's path."""
  for entry in pythonpath.split(os.pathsep):
    if entry and os.path.isfile(os.path.join(entry, "maxtext", "configs", "base.yml")):
      return os.path.join(entry, "maxtext")
  raise FileNotFoundError(f"no maxtext/configs/base.yml on {ARM_PATH_ENV}={pythonpath!r} "
                          "(source benchmarks/tpu_install.sh first)")


def _maxtext_first_step_s(text: str, launch: float) -> float | None:
  """Seconds from launch to MaxText's `completed step: 0` log line (absl's local HH:MM:SS.us)."""
  m = re.search(r"^I\d{4} (\d\d):(\d\d):(\d\d\.\d+) .*completed step: 0,", text, re.M)
  if not m:
    return None
  t0 = datetime.datetime.fromtimestamp(launch)
  h, mi, s = int(m.group(1)), int(m.group(2)), float(m.group(3))
  stamp = t0.replace(hour=h, minute=mi, second=0, microsecond=0) + datetime.timedelta(seconds=s)
  if stamp < t0 - datetime.timedelta(minutes=1):   # past midnight
    stamp += datetime.timedelta(days=1)
  return round((stamp - t0).total_seconds(), 1)


def maxtext_row(overrides: Sequence[str] = (), *, steps: int = 12, warmup: int = 5,
                peak_tflops: float = V5E_PEAK_TFLOPS, python: str = sys.executable,
                pythonpath: str | None = None, timeout_s: float | None = None,
                work: str | None = None) -> dict[str, Any]:
  """MaxText 0.2.5's row, on the arm's path only ($MAXTEXT_ARM_PYTHONPATH by default)."""
  path = pythonpath or os.environ.get(ARM_PATH_ENV) or DEFAULT_ARM_PATH
  pkg = arm_package(path)
  with _Work(work) as wd:
    metrics = os.path.join(wd, "maxtext_metrics.jsonl")
    keys = merge_keys({"run_name": "maxtext", "base_output_directory": wd,
                       "dataset_type": "synthetic", "steps": str(steps),
                       "enable_checkpointing": "false", "skip_jax_distributed_system": "true",
                       "jax_cache_dir": "", "enable_tensorboard": "false",
                       "metrics_file": metrics}, overrides)
    metrics = dict(k.split("=", 1) for k in keys)["metrics_file"]
    cmd = [python, "-m", "maxtext.trainers.pre_train.train",
           os.path.join(pkg, "configs", "base.yml"), *keys]
    env = dict(os.environ, PYTHONPATH=path, DECOUPLE_GCLOUD="TRUE")
    log = os.path.join(wd, "maxtext.log")
    rc, wall, launch = _run(cmd, env=env, cwd=wd, log=log, timeout_s=timeout_s)
    rec, text = _record("maxtext", cmd, metrics, log, wall, warmup=warmup,
                        peak_tflops=peak_tflops)
    m = re.search(r"Num_devices: (\d+)", text)
    rec["devices"] = int(m.group(1)) if m else None
    if rec["devices"] and rec.get("tokens_per_s_per_device") is not None:
      rec["tokens_per_s"] = rec["tokens_per_s_per_device"] * rec["devices"]
    rec["first_step_s"] = _maxtext_first_step_s(text, launch)
    return _finish(rec, rc, log)


def parse_args(argv: Sequence[str], trainer: str | None = None) -> argparse.Namespace:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  if trainer is None:
    ap.add_argument("trainer", choices=("ours", "maxtext"))
  ap.add_argument("--steps", type=int, default=12)
  ap.add_argument("--warmup", type=int, default=5, help="steps left out of the medians")
  ap.add_argument("--peak-tflops", type=float, default=V5E_PEAK_TFLOPS,
                  help="per-device peak for MFU (default 197: TPU v5e bf16)")
  ap.add_argument("--timeout", type=float, default=None, help="seconds before the run is killed")
  ap.add_argument("--work", default=None, help="run directory to keep (default: a temporary one)")
  ap.add_argument("keys", nargs="*", help="key=value config overrides")
  args = ap.parse_intermixed_args(argv)
  if trainer is not None:
    args.trainer = trainer
  bad = [k for k in args.keys if "=" not in k or k.startswith("=")]
  if bad:
    ap.error(f"not key=value: {' '.join(bad)}")
  if args.steps <= args.warmup:
    ap.error(f"--steps {args.steps} leaves no step after --warmup {args.warmup}")
  return args


def main(argv: Sequence[str], trainer: str | None = None) -> int:
  args = parse_args(argv, trainer)
  row = ours_row if args.trainer == "ours" else maxtext_row
  try:
    rec = row(args.keys, steps=args.steps, warmup=args.warmup, peak_tflops=args.peak_tflops,
              timeout_s=args.timeout, work=args.work)
  except FileNotFoundError as e:
    print(f"tpu_rows: {e}", file=sys.stderr)
    return 2
  print(json.dumps(rec))
  if rec["exit_status"] != 0:
    return rec["exit_status"]
  return 0 if rec.get("steps_used") else 1


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
