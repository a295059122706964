"""Issue 38's intermittent abort: runs a single-process 8-device CPU training run repeatedly, several
at once, optionally next to a memory-heavy neighbour, and counts how they ended.

  .venv/bin/python benchmarks/abort_stress.py [--runs 12] [--concurrent 3] [--hog-gib 4]
      [--steps 6] [--out /tmp/abort_stress] [--gdb] [--fresh-compile] [--env NAME=VALUE ...]
      [--devices 8] [-- key=value ...]

Each run is `train.py configs/base.yml dataset_type=synthetic steps=6 dtype=float32
per_device_batch_size=1 ici_data_parallelism=2 ici_fsdp_parallelism=2 ici_tensor_parallelism=2`
with `XLA_FLAGS=--xla_force_host_platform_device_count=8` (the issue's configuration; keys after
`--` are added). `--devices N` other than 8: N devices, the mesh all FSDP
(`ici_fsdp_parallelism=N`, as the side-by-side matrix's fsdp rows); any `ici_*` key after `--`
replaces the mesh, in its own run directory under `--out`, its stdout+stderr in `<out>/run-N.log`.
`--hog-gib G`: a neighbour process that holds G GiB and keeps writing to every page of it while the
runs go (page-cache and reclaim pressure). `--gdb`: when a run's log says a collective "may be
stuck" (XLA:CPU warns after 20 s, aborts after 40 s), every thread's stack of that process is
written to `<out>/run-N.gdb.txt` by `gdb -p` (needs gdb and ptrace permission).

Prints one line per finished run (exit status, signal, wall time, whether XLA:CPU reported a stuck
collective rendezvous) and a summary: runs, aborts (SIGABRT), exit statuses.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = ["dataset_type=synthetic", "dtype=float32", "per_device_batch_size=1"]
MESH_8 = ["ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"]
STUCK = "may be stuck"
RENDEZVOUS_ABORT = re.compile(r"Termination timeout for `([a-z\- ]+) RendezvousKey")

HOG = """
import sys, time
size = int(float(sys.argv[1]) * (1 << 30))
buf = bytearray(size)
page, value = 4096, 1
while True:
  for i in range(0, size, page):
    buf[i] = value
  value = value % 255 + 1
  time.sleep(0.05)
"""


def run_once(index: int, args: argparse.Namespace, extra: list[str], env: dict) -> dict:
  log_path = os.path.join(args.out, f"run-{index}.log")
  cmd = [sys.executable, os.path.join(ROOT, "train.py"), os.path.join(ROOT, "configs/base.yml"),
         *CONFIG, *mesh(args.devices, extra), f"steps={args.steps}", f"base_output_directory={args.out}",
         f"run_name=run-{index}", *extra]
  t0 = time.monotonic()
  with open(log_path, "w", encoding="utf-8") as log:
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    dumped = False
    while proc.poll() is None:
      time.sleep(1.0)
      if args.gdb and not dumped and STUCK in _read(log_path):
        dumped = True
        _gdb_dump(proc.pid, os.path.join(args.out, f"run-{index}.gdb.txt"))
  text = _read(log_path)
  rc = proc.returncode
  match = RENDEZVOUS_ABORT.search(text)
  return {"index": index, "rc": rc, "signal": signal.Signals(-rc).name if rc < 0 else "",
          "wall_s": time.monotonic() - t0, "stuck": STUCK in text,
          "rendezvous": match.group(1) if match else ""}


def mesh(devices: int, extra: list[str]) -> list[str]:
  """The mesh keys, unless the keys after `--` give the mesh (any `ici_*` key)."""
  if any(a.startswith("ici_") for a in extra):
    return []
  if devices == 8:
    return MESH_8
  return ["ici_data_parallelism=1", f"ici_fsdp_parallelism={devices}", "ici_tensor_parallelism=1"]


def _read(path: str) -> str:
  with open(path, encoding="utf-8", errors="replace") as f:
    return f.read()


def _gdb_dump(pid: int, path: str) -> None:
  if shutil.which("gdb") is None:
    return
  with open(path, "w", encoding="utf-8") as f:
    try:   # a loaded machine can take minutes to read the symbols; the run aborts meanwhile
      subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt"],
                     stdout=f, stderr=subprocess.STDOUT, timeout=300, check=False)
    except subprocess.TimeoutExpired:
      f.write("\n(gdb timed out)\n")


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--runs", type=int, default=12)
  parser.add_argument("--concurrent", type=int, default=3)
  parser.add_argument("--hog-gib", type=float, default=0.0)
  parser.add_argument("--steps", type=int, default=6)
  parser.add_argument("--out", default="/tmp/abort_stress")
  parser.add_argument("--gdb", action="store_true")
  parser.add_argument("--devices", type=int, default=8)
  parser.add_argument("--fresh-compile", action="store_true",
                      help="jax_cache_dir= (off): every run compiles its step, as the first run "
                           "of a configuration does; otherwise all but the first load it")
  parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                      help="set in the runs' environment (e.g. NPROC=2)")
  args, rest = parser.parse_known_args()
  extra = [a for a in rest if a != "--"] + (["jax_cache_dir="] if args.fresh_compile else [])
  os.makedirs(args.out, exist_ok=True)
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={args.devices}",
             PYTHONFAULTHANDLER="1")
  for item in args.env:
    name, _, value = item.partition("=")
    env[name] = value
  hog = None
  if args.hog_gib > 0:
    hog = subprocess.Popen([sys.executable, "-c", HOG, str(args.hog_gib)])
  print(f"{args.runs} runs of {args.devices} devices, {args.concurrent} at once, "
        f"memory hog {args.hog_gib:g} GiB, "
        f"steps={args.steps} {' '.join(extra)} {' '.join(args.env)}; logs in {args.out}", flush=True)
  results, lock = [], threading.Lock()

  def one(i: int) -> None:
    r = run_once(i, args, extra, env)
    with lock:
      results.append(r)
      print(f"run {r['index']:3d}: exit {r['rc']:4d} {r['signal']:8s} {r['wall_s']:6.1f} s"
            f"{'  stuck collective' if r['stuck'] else ''}"
            f"{'  (aborted in ' + r['rendezvous'] + ')' if r['rendezvous'] else ''}", flush=True)

  t0 = time.monotonic()
  try:
    with ThreadPoolExecutor(args.concurrent) as pool:
      list(pool.map(one, range(args.runs)))
  finally:
    if hog is not None:
      hog.kill()
      hog.wait()
  codes = collections.Counter(r["rc"] for r in results)
  aborts = sum(r["rc"] == -signal.SIGABRT for r in results)
  stuck = sum(r["stuck"] for r in results)
  print(f"runs {len(results)} | aborts (SIGABRT) {aborts} | runs with a stuck collective {stuck} | "
        f"exit statuses {dict(sorted(codes.items()))} | {time.monotonic() - t0:.0f} s in all",
        flush=True)
  return 1 if aborts or any(c != 0 for c in codes) else 0


if __name__ == "__main__":
  sys.exit(main())
