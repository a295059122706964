"""Where a request's latency goes at 4 clients, against its solo latency: the server's engine
(MaxText/serve/scheduler.py over MaxText/decoding/slots.py) in this process, without HTTP, on
serve_load.py's model and requests, every engine call timed (`Scheduler(on_call=...)`).

  .venv/bin/python benchmarks/serve_breakdown.py [--layers 4] [--dim 256] [--vocab 8192]
      [--requests 16] [--repeats 2] [--arms busy all] [--set serve_chunk=8 ...]

Per round: solo (one request at a time) then 4 clients (4 threads, each takes the next request
when its last one finished). Each request's time from submit to its last token is split by the
engine calls it overlaps: `wait` (before its own first prefill call: the call in flight and
others' calls queued before it), `own` (its prefill calls), `others` (other requests' prefill
calls after its own first one), `decode` (decoding calls after its first one: steps at the
batch of the moment) and `host` (the rest: the engine thread between calls). Printed: per
request (solo | 4 clients), then the sums over the requests; ratios latency / solo latency.
`--set` takes the server's keys serve_slots, serve_chunk, serve_prefill_chunk and any config key.
`--arms busy all` interleaves, per round, decoding calls over the busy slots' rows only (the
server's way, `Slots.step_rows`) and over every slot's row; the last lines sum each arm's rounds.
Every decoding program is compiled before the rounds (`Slots.warm`).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

PARTS = ("wait", "own", "others", "decode", "host")


def closed_loop(reqs: list, clients: int, one) -> list[dict]:
  """`reqs` by `clients` threads, each taking the next request when its last one finished (a
  closed loop); `one(request)` runs one request to its end and returns its record. The records in
  `reqs`' order."""
  queue = list(enumerate(reqs))
  lock = threading.Lock()
  out: list[dict] = [{} for _ in reqs]

  def client():
    while True:
      with lock:
        if not queue:
          return
        i, req = queue.pop(0)
      out[i] = one(req)
  threads = [threading.Thread(target=client) for _ in range(clients)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  return out


def run(sched, reqs, clients: int, calls: list) -> list[dict]:
  """`reqs` by `clients` threads; per request its submit/end times and its slot's calls."""
  from MaxText.serve.scheduler import Job

  def one(req):
    p, n = req
    done = threading.Event()
    job = Job(p, n, lambda d, e=done: e.set() if d.finish_reason else None)
    t0 = time.perf_counter()
    sched.submit([job])
    done.wait()
    return {"t0": t0, "t1": time.perf_counter(), "job": job}
  calls.clear()
  return closed_loop(reqs, clients, one)


def split(r: dict, calls: list) -> dict:
  """The parts of request `r`'s latency (module docstring)."""
  t0, t1, job = r["t0"], r["t1"], r["job"]
  mine = [c for c in calls if job in c["jobs"]]
  begun = min(c["t0"] for c in mine if c["kind"] != "step")
  parts = dict.fromkeys(PARTS, 0.0)
  parts["wait"] = begun - t0
  steps = []
  for c in calls:
    a, b = max(c["t0"], begun), min(c["t1"], t1)
    if b <= a:
      continue
    if c["kind"] == "step":
      parts["decode"] += b - a
      if job in c["jobs"]:
        steps.append((c["t1"] - c["t0"], c["n"], len(c["jobs"])))
    elif job in c["jobs"]:
      parts["own"] += b - a
    else:
      parts["others"] += b - a
  parts["host"] = (t1 - t0) - sum(parts.values())
  parts["latency"] = t1 - t0
  made = sum(n for _, n, _ in steps)
  parts["per_step"] = sum(s for s, _, _ in steps) / max(made, 1)
  parts["batch"] = float(np.mean([b for _, _, b in steps])) if steps else 0.0
  return parts


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--dim", type=int, default=256)
  ap.add_argument("--vocab", type=int, default=8192)
  ap.add_argument("--requests", type=int, default=16)
  ap.add_argument("--repeats", type=int, default=2)
  ap.add_argument("--set", nargs="*", default=[])
  ap.add_argument("--arms", nargs="*", default=["busy"], choices=["busy", "all"],
                  help="decoding calls over the busy slots' rows (the server's way) and/or over "
                  "every slot's row (as before that), interleaved per round")
  args = ap.parse_args()
  import jax
  from serve_load import requests_of, save_model
  from MaxText import inference
  from MaxText.decoding.slots import Slots
  from MaxText.serve.scheduler import Scheduler
  reqs = requests_of(argparse.Namespace(clients=args.requests, requests=1, vocab=args.vocab))
  folder = tempfile.mkdtemp(prefix="serve_breakdown_")
  save_model(args, folder)
  keys = {"serve_slots": "16", "serve_chunk": "8", "serve_prefill_chunk": "128",
          "serve_prefix_cache": "0"}
  rest = []
  for kv in args.set:
    k, v = kv.split("=", 1)
    if k in keys:
      keys[k] = v
    else:
      rest.append(kv)
  model = inference.load([os.path.join(ROOT, "configs", "base.yml"), f"hf_path={folder}",
                          "dtype=float32", "ici_fsdp_parallelism=1", "max_cache_length=512",
                          *[f"{k}={v}" for k, v in keys.items()], *rest], jax.devices()[:1])
  cfg = model.cfg
  slots = Slots(model.engine, cfg.serve_slots, 512, chunk=cfg.serve_chunk)
  calls: list = []

  seen = [0]

  def on_call(kind, served, n, t0, t1):
    jobs = [sched.jobs[s] for s in served]
    compiled, seen[0] = slots.compiled_programs() - seen[0], slots.compiled_programs()
    calls.append({"kind": kind, "jobs": jobs, "n": n, "compiled": compiled, "rows": len(served), "t0": t0, "t1": t1})
  sched = Scheduler(model, slots, 64, prefill_chunk=cfg.serve_prefill_chunk,
                    prefix_min=cfg.serve_prefix_cache, on_call=on_call)
  warmed = slots.warm(model.params)        # every decoding program: none compiles in a round
  sched.start()
  print(f"{args.layers} layers, d {args.dim}, vocab {args.vocab}; {keys}; {warmed} decoding "
        f"programs warmed; load "
        f"{os.getloadavg()[0]:.1f}", flush=True)
  try:
    for clients in (1, 4):                      # warm-up: the programs compile
      run(sched, reqs, clients, calls)
    busy_rows = slots.step_rows
    arms = {"busy": busy_rows, "all": lambda busy: np.arange(slots.slots, dtype=np.int32)}
    summary = {arm: [] for arm in args.arms}
    for r, arm in ((r, arm) for r in range(args.repeats) for arm in args.arms):
      slots.step_rows = arms[arm]
      solo = [split(x, calls) for x in run(sched, reqs, 1, calls)]
      solo_calls = list(calls)
      four_runs = run(sched, reqs, 4, calls)
      four = [split(x, calls) for x in four_runs]
      print(f"round {r + 1}, {arm} rows, load {os.getloadavg()[0]:.1f}; per request (ms) solo | "
            "4 clients:")
      print("  prompt new | solo: latency wait own decode/step | 4 clients: latency " +
            " ".join(PARTS) + " decode/step batch | ratio")
      for (p, n), s, f in zip(reqs, solo, four):
        ms = lambda x: f"{1000 * x:6.1f}"
        print(f"  {len(p):6d} {n:3d} | {ms(s['latency'])} {ms(s['wait'])} {ms(s['own'])} "
              f"{ms(s['per_step'])} | {ms(f['latency'])} " + " ".join(ms(f[k]) for k in PARTS)
              + f" {ms(f['per_step'])} {f['batch']:4.1f} | {f['latency'] / s['latency']:5.2f}")
      ratios = [f["latency"] / s["latency"] for s, f in zip(solo, four)]
      summary[arm].append((max(ratios), float(np.median(ratios)),
                           sum(s["latency"] for s in solo), sum(f["latency"] for f in four)))
      tot = {k: sum(f[k] for f in four) for k in (*PARTS, "latency")}
      steps1 = [c for c in solo_calls if c["kind"] == "step"]
      steps4 = [c for c in calls if c["kind"] == "step"]
      per = lambda cs: 1000 * sum(c["t1"] - c["t0"] for c in cs) / max(sum(c["n"] for c in cs), 1)
      print(f"  ratio max {max(ratios):.2f} median {float(np.median(ratios)):.2f}; 4 clients, "
            f"summed over requests: " + ", ".join(f"{k} {tot[k] / tot['latency']:.0%}"
                                                  for k in PARTS)
            + f"; ms per decoding step: solo {per(steps1):.2f}, 4 clients {per(steps4):.2f}"
            + f"; prefill calls solo {sum(c['kind'] != 'step' for c in solo_calls)}, 4 clients "
            f"{sum(c['kind'] != 'step' for c in calls)}; programs compiled: solo "
            f"{sum(c['compiled'] for c in solo_calls)}, 4 clients "
            f"{sum(c['compiled'] for c in calls)}", flush=True)
      for c in calls:
        if c["compiled"]:
          print(f"  compiled in a 4-client call: {c['kind']}, {c['rows']} rows, {c['n']} tokens, "
                f"{1000 * (c['t1'] - c['t0']):.0f} ms")
    for arm, got in summary.items():
      print(f"{arm} rows: ratio max " + " / ".join(f"{g[0]:.2f}" for g in got) + ", median "
            + " / ".join(f"{g[1]:.2f}" for g in got) + "; summed latency (s) solo "
            + " / ".join(f"{g[2]:.2f}" for g in got) + ", 4 clients "
            + " / ".join(f"{g[3]:.2f}" for g in got) + f"; load {os.getloadavg()[0]:.1f}")
  finally:
    sched.stop()


if __name__ == "__main__":
  main()
