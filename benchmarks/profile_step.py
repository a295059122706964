"""Where the train step's time goes, for the reference tiny config (the one of `tiny_train.py`) on
N fake CPU devices (fsdp over all of them unless overrides say otherwise). Three views:

  .venv/bin/python benchmarks/profile_step.py [--devices 1] [--dtype bfloat16] [--top 40] [key=value ...]
  .venv/bin/python benchmarks/profile_step.py --devices 2 --collectives
  .venv/bin/python benchmarks/profile_step.py --devices 2 --loop 20 [--trace]
  .venv/bin/python benchmarks/profile_step.py --devices 4 --categories ici_data_parallelism=2 ici_fsdp_parallelism=2
  .venv/bin/python benchmarks/profile_step.py --devices 4 --categories --top 40 --hlo /tmp/ours4.hlo

MaxText's step, traced and put in the same categories: `profile_maxtext.py` (its `--ours-hlo` takes
the `--hlo` file written here and sets the two steps' dot FLOP side by side).

Default: the compiled step run under `jax.profiler` with XLA:CPU's per-op trace events
(`--xla_cpu_enable_xprof_traceme=true`); prints the ops' time per step, largest first, each with its
output shape and the jax operations fused into it (from the compiled HLO's metadata). Times are
summed over every device's ops (an op inside the layer scan counts all its layers), so their total
exceeds the wall time when the devices or XLA's threads run in parallel. On a busy machine they
stretch, but their shares stay meaningful.

--categories: the same trace, its ops summed by what they do (the layer scan's weight matmuls
forward / backward, attention core, element-wise work, copies and stacked buffers, collectives; the
loss and LM head's chunk loop; embedding; optimizer; zero-filled buffers; ...), read from each op's
jax operation names in the compiled HLO, with the process's CPU seconds per traced step beside
them (with --top N, also the N largest ops, each with its category). With more devices than cores
the devices' threads are descheduled inside ops, so op times then exceed CPU time: compare shares
between runs with the same device count, not seconds.

--collectives: the compiled step's collectives (nothing is run): each all-gather / reduce-scatter /
all-reduce / all-to-all with its operand shapes, bytes, and whether it sits inside the layer scan
(once per layer) or outside it (once per step); every one is a rendezvous of all device threads.

--loop N: the real loop (`Trainer.run`, synthetic data, no checkpoints, N steps) with the CPU time
of each of the process's threads read from /proc between the metrics rows of steps 5 and N-1:
XLA:CPU's intra-op pool (`tf_XLAEigen`: every op of every device runs there), the device threads
(PjRt's per-device executors: launching ops, rendezvous), the main thread (dispatch, batches,
metrics rows) and the rest. Per-thread CPU depends little on the machine's load; wall time does.
With --trace, also the perfetto trace of those steps: how much of the wall time 0, 1, 2, ... of the
pool's threads were running an op (the trace events cost time themselves: read shares, not times).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import gzip
import io
import json
import math
import os
import re
import sys
import tempfile
import threading
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


# ---- --categories ------------------------------------------------------------------------------
# the loss's chunk loop is the while loop whose body picks each position's target logit out of the
# logits (`jnp.take_along_axis`, losses/loss_parts.py); no layer does (the embedding lookup is a take
# outside the loops). Found by what it computes, not by a shard_map around it (absent at 1 device).
LOSS_MARK = "take_along_axis"
SCAN, LOSS_LOOP = "layer scan", "loss chunk loop"   # `op_info`'s loop kinds ("" outside loops)


def op_info(hlo: str) -> dict[str, tuple[str, str, str, list[str]]]:
  """instruction name → (the kind of while loop it sits in: `LOSS_LOOP`, `SCAN` or "" outside
  every loop; opcode, output shape, jax operation names of it and of the computation it calls)."""
  bodies = {m.group(1): m.group(2)
            for m in re.finditer(r"^(?:ENTRY )?%?([\w.\-]+) \(.*?\{\n(.*?)\n\}", hlo, re.M | re.S)}
  calls = {c: set(re.findall(r"(?:calls|body|condition|to_apply)=%?([\w.\-]+)", b))
           for c, b in bodies.items()}

  def reached(c: str) -> set[str]:   # a loop body and everything it calls
    seen, todo = set(), [c]
    while todo:
      c = todo.pop()
      if c not in seen:
        seen.add(c)
        todo += calls.get(c, ())
    return seen

  loop_of: dict[str, str] = {}
  for body in set(re.findall(r"body=%?([\w.\-]+)", hlo)):
    inside = reached(body)
    kind = LOSS_LOOP if any(LOSS_MARK in bodies.get(c, "") for c in inside) else SCAN
    for c in inside:
      if loop_of.get(c) != LOSS_LOOP:   # a loop nested in the loss loop is the loss loop's
        loop_of[c] = kind
  out = {}
  for c, body in bodies.items():
    for line in body.splitlines():
      m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (\(.*?\)|\S+) ([\w\-]+)\(", line)
      if m:
        called = re.search(r"calls=%?([\w.\-]+)", line)
        text = bodies.get(called.group(1), "") + line if called else line
        out[m.group(1)] = (loop_of.get(c, ""), m.group(3), m.group(2),
                           re.findall(r'op_name="([^"]+)"', text))
  return out


def op_parts(info: tuple[str, str, str, list[str]]) -> tuple[str, str, str, str, set[str], int]:
  """An `op_info` entry as (its loop kind, opcode, output shape, its jax operation names joined,
  their last components, the output's rank)."""
  loop, opcode, shape, names = info
  dims = re.match(r"\w+\[([\d,]*)\]", shape)
  rank = len(dims.group(1).split(",")) if dims and dims.group(1) else 0
  return loop, opcode, shape, " ".join(names), {n.split("/")[-1] for n in names}, rank


def category(name: str, info: tuple[str, str, str, list[str]] | None) -> str:
  """What an op of the tiny llama step does (`--categories`), from its jax operation names."""
  if name.startswith(COLLECTIVES + ("all_gather", "all_reduce", "reduce_scatter", "psum",
                                    "InvokeRendezvous")):
    if info and info[0] == SCAN:
      return "layer scan: collectives (kernel gathers, gradient all-reduce)"
    return "collectives outside the layer scan (loss, head, embedding, metrics)"
  if info is None:
    return "runtime (launch, arguments)"
  loop, opcode, shape, text, last, rank = op_parts(info)
  if "_take" in text or "scatter-add" in last:
    return "embedding lookup and its gradient"
  if loop == LOSS_LOOP:
    return "loss + LM head: the chunk loop"
  if loop:
    if name.startswith("ynn_fusion") and rank == 2:
      backward = "transpose(jvp" in text and "rematted_computation" not in text
      return f"layer scan: weight matmuls, {'backward' if backward else 'forward (and remat)'}"
    if name.startswith("ynn_fusion") or rank >= 4:
      return "layer scan: attention core"
    if opcode in ("copy", "concatenate", "dynamic-update-slice", "dynamic-slice") or re.search(
        r"copy|concatenate|dynamic-update-slice|dynamic-slice", name):
      return "layer scan: copies, concatenates, stacked buffers"
    return "layer scan: element-wise (norms, RoPE, SiLU, converts)"
  if "is_finite" in last or name.startswith("broadcast_divide"):
    return "optimizer (clip, AdamW, non-finite guard)"
  if "shard_map" in text:
    return "loss + LM head outside the chunk loop"
  if name.startswith("wrapped_broadcast"):
    return "zero-filled buffers (scan outputs, gradients)"
  if opcode == "copy" or "copy" in name:
    return "copies outside the loops"
  return "other"


def print_categories(times: collections.Counter, hlo: str, cpu: float, wall: float) -> None:
  info, by = op_info(hlo), collections.Counter()
  for name, s in times.items():
    by[category(name, info.get(name))] += s
  total = sum(by.values())
  print(f"process CPU per step (traced) {cpu:.3f} s, wall {wall:.3f} s, op time {total:.3f} s")
  print("| category | op s per step | share |\n|---|---|---|")
  for name, s in by.most_common():
    print(f"| {name} | {s:.4f} | {100 * s / total:.1f} % |")


# ---- --collectives ------------------------------------------------------------------------------
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "u16": 2, "s16": 2, "f32": 4,
             "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def collectives(hlo: str) -> list[dict]:
  """Every collective of the compiled module: kind, operand shapes, bytes, inside a loop body."""
  bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo))
  found, computation = [], None
  for line in hlo.splitlines():
    if not line.startswith(" "):
      head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
      computation = head.group(1) if head else computation
      continue
    m = re.match(r"\s*(?:ROOT )?%?[\w.\-]+ = (.*?) (" + "|".join(COLLECTIVES) + r")(-start)?\(", line)
    if not m:
      continue
    shapes = re.findall(r"(\w+)\[([\d,]*)\]", m.group(1))
    nbytes = sum(_ITEMSIZE.get(t, 4) * math.prod(int(d) for d in dims.split(",") if d)
                 for t, dims in shapes)
    op = re.search(r'op_name="([^"]+)"', line)
    found.append(dict(kind=m.group(2), shapes=" ".join(f"{t}[{d}]" for t, d in shapes),
                      bytes=nbytes, in_scan=computation in bodies,
                      op=(op.group(1) if op else "").replace("jit(step)/", "")))
  return found


def print_collectives(found: list[dict], n: int, dtype: str) -> None:
  print(f"{n} device(s), {dtype}: {len(found)} collectives in the compiled step "
        f"({sum(c['in_scan'] for c in found)} inside the layer scan, run once per layer)")
  print("| where | kind | operands | KiB | jax operation |\n|---|---|---|---|---|")
  for c in sorted(found, key=lambda c: (not c["in_scan"], c["kind"], -c["bytes"])):
    print(f"| {'scan' if c['in_scan'] else 'step'} | {c['kind']} | `{c['shapes'][:60]}` | "
          f"{c['bytes'] / 1024:,.0f} | {c['op'][-70:]} |")
  counts = collections.Counter((c["in_scan"], c["kind"]) for c in found)
  print("per step, by kind: " + ", ".join(
      f"{k} {counts[(True, k)]} in the scan + {counts[(False, k)]} outside"
      for k in COLLECTIVES if counts[(True, k)] or counts[(False, k)]))


# ---- --loop --------------------------------------------------------------------------------------
def thread_cpu() -> dict[tuple[str, str], float]:
  """(thread id, name) → CPU seconds (user + system) of this process's threads, from /proc."""
  tick, out = os.sysconf("SC_CLK_TCK"), {}
  for tid in os.listdir("/proc/self/task"):
    try:
      with open(f"/proc/self/task/{tid}/stat", encoding="ascii", errors="replace") as f:
        text = f.read()
    except OSError:
      continue   # the thread ended
    fields = text.rsplit(")", 1)[1].split()
    out[(tid, text[text.index("(") + 1:text.rindex(")")])] = (int(fields[11]) + int(fields[12])) / tick
  return out


def thread_class(tid: str, name: str, device_tids: set[str]) -> str:
  if name.startswith("tf_XLAEigen"):
    return "XLA intra-op pool (every device's ops)"
  if tid in device_tids or name.startswith(("tf_XLAPjRt", "tf_XLAExecute")):
    return "device threads (launch, rendezvous)"
  if int(tid) == threading.main_thread().native_id:
    return "main thread (dispatch, batches, metrics)"
  return "other threads (data, compile, ...)"


def pool_concurrency(trace_dir: str) -> tuple[float, collections.Counter]:
  """(window seconds, number of XLA pool threads running an op → seconds) from the trace."""
  path = sorted(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True))[-1]
  events = json.load(gzip.open(path))
  events = events["traceEvents"] if isinstance(events, dict) else events
  pool = {(e["pid"], e["tid"]) for e in events if e.get("ph") == "M"
          and e.get("name") == "thread_name" and e["args"]["name"].startswith("tf_XLAEigen")}
  ops = [e for e in events if e.get("ph") == "X" and "dur" in e and (e["pid"], e["tid"]) in pool
         and not e["name"].startswith(WRAPPERS + ("ThreadpoolListener", "InvokeRendezvous"))
         and not e["name"].startswith(COLLECTIVES)]
  edges = []
  for thread in pool:   # each thread's busy intervals (nested events merged), as +1/-1 edges
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in ops if (e["pid"], e["tid"]) == thread)
    merged: list[list[float]] = []
    for a, b in spans:
      if merged and a <= merged[-1][1]:
        merged[-1][1] = max(merged[-1][1], b)
      else:
        merged.append([a, b])
    edges += [(a, 1) for a, _ in merged] + [(b, -1) for _, b in merged]
  edges.sort()
  hist, running, last = collections.Counter(), 0, edges[0][0]
  for t, d in edges:
    hist[running] += (t - last) / 1e6
    running, last = running + d, t
  return (edges[-1][0] - edges[0][0]) / 1e6, hist


def profile_loop(trainer_cls, cfg, steps: int, trace_dir: str | None) -> None:
  """Runs the training loop and prints the CPU per step of each class of thread (see --loop)."""
  import jax  # pylint: disable=import-outside-toplevel
  first, marks = 5, {}

  class Probe(trainer_cls):
    def _finish_step(self, step, *a, **k):
      code = super()._finish_step(step, *a, **k)
      if step in (first, steps - 1):
        marks[step] = (time.perf_counter(), thread_cpu(), os.getloadavg()[0])
        if trace_dir and step == first:
          options = jax.profiler.ProfileOptions()
          options.python_tracer_level = 0
          jax.profiler.start_trace(trace_dir, create_perfetto_trace=True, profiler_options=options)
        if trace_dir and step == steps - 1:
          jax.profiler.stop_trace()
      return code

  trainer = Probe(cfg)
  device_tids = set()
  with contextlib.redirect_stdout(io.StringIO()):
    if trainer.run() != 0:
      raise SystemExit("the run failed")
  (w0, cpu0, load0), (w1, cpu1, load1) = marks[first], marks[steps - 1]
  k = steps - 1 - first
  # PjRt's device threads are unnamed on some jax versions: the threads that spent CPU in the
  # steps and are neither the pool, the main thread nor Python's own threads
  python_tids = {str(t.native_id) for t in threading.enumerate()}
  for (tid, name), c in cpu1.items():
    if (c - cpu0.get((tid, name), 0.0) > 0 and tid not in python_tids
        and not name.startswith(("tf_", "llvm")) and name in ("python", "python3")):
      device_tids.add(tid)
  by_class = collections.Counter()
  for (tid, name), c in cpu1.items():
    by_class[thread_class(tid, name, device_tids)] += c - cpu0.get((tid, name), 0.0)
  total = sum(by_class.values())
  print(f"{len(trainer.devices)} device(s), {cfg.dtype}, the loop (Trainer.run), steps "
        f"{first + 1}-{steps - 1}: {(w1 - w0) / k:.3f} s wall and {total / k:.3f} CPU-s per step "
        f"({total / (w1 - w0):.2f} cores busy; load average {load0:.1f} -> {load1:.1f})")
  print("| threads | CPU-s per step | share |\n|---|---|---|")
  for name, c in by_class.most_common():
    print(f"| {name} | {c / k:.4f} | {100 * c / total:.1f} % |")
  if trace_dir:
    window, hist = pool_concurrency(trace_dir)
    print(f"traced: the XLA pool's threads running an op, share of {window:.2f} s wall "
          "(trace events slow the ops down): " + ", ".join(
              f"{m} threads {100 * s / window:.1f} %" for m, s in sorted(hist.items())))


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--devices", type=int, default=1)
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--top", type=int, default=None,
                  help="the N largest ops (default 40; with --categories none unless given)")
  ap.add_argument("--collectives", action="store_true", help="list the compiled step's collectives")
  ap.add_argument("--categories", action="store_true", help="the traced ops' time by category")
  ap.add_argument("--loop", type=int, default=0, metavar="N",
                  help="run the training loop for N steps (>= 8); CPU per step by thread")
  ap.add_argument("--trace", action="store_true", help="with --loop: also the pool's concurrency")
  ap.add_argument("--hlo", default="", metavar="FILE", help="also write the compiled step's HLO text "
                  "there (for `profile_maxtext.py --ours-hlo`)")
  ap.add_argument("overrides", nargs="*", help="extra key=value config overrides")
  args = ap.parse_args()
  n = args.devices
  if args.loop and args.loop < 8:
    ap.error("--loop needs at least 8 steps (steps 6..N-1 are measured)")
  traceme = not (args.collectives or (args.loop and not args.trace))
  os.environ["XLA_FLAGS"] = (f"--xla_force_host_platform_device_count={n}"
                             + (" --xla_cpu_enable_xprof_traceme=true" if traceme else ""))
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
      "run_name=profile", f"steps={max(args.loop, 1)}", "enable_checkpointing=false",
      "enable_tensorboard=false", "sample_at_end=false"]
  given = {k.split("=", 1)[0] for k in args.overrides}   # an override replaces the default above
  keys = [k for k in keys if k.split("=", 1)[0] not in given] + args.overrides
  cfg = load_config([os.path.join(ROOT, "configs/base.yml"), *keys], keep_auto=True)
  if args.loop:
    profile_loop(Trainer, cfg, args.loop, os.path.join(work, "trace") if args.trace else None)
    return 0
  trainer = Trainer(cfg)
  compiled = trainer.compile_step()
  if args.hlo:
    with open(args.hlo, "w") as f:
      f.write(compiled.as_text())
  if args.collectives:
    print_collectives(collectives(compiled.as_text()), n, trainer.cfg.dtype)
    return 0
  state = init_state(trainer.mcfg, 0, trainer.tx, trainer.shardings)
  batch = synthetic_batch(trainer)
  for _ in range(STEPS):   # warm-up
    state, metrics = compiled(state, batch)
  jax.block_until_ready(metrics)
  jax.profiler.start_trace(work, create_perfetto_trace=True)
  t0, cpu0 = time.perf_counter(), os.times()
  for _ in range(STEPS):
    state, metrics = compiled(state, batch)
  jax.block_until_ready(metrics)
  wall, cpu1 = (time.perf_counter() - t0) / STEPS, os.times()
  jax.profiler.stop_trace()
  cpu = (cpu1.user + cpu1.system - cpu0.user - cpu0.system) / STEPS

  (times, waited), shapes = op_times(work), describe(compiled.as_text())
  if args.categories:
    print(f"{n} device(s), {args.dtype} (load average {os.getloadavg()[0]:.2f}); "
          f"{waited:.3f} s per step waiting at collectives' rendezvous")
    print_categories(times, compiled.as_text(), cpu, wall)
    if not args.top:
      return 0
  info = op_info(compiled.as_text())
  total = sum(times.values())
  collective = sum(s for name, s in times.items() if name.startswith(COLLECTIVES))
  print(f"{n} device(s), {args.dtype}: {wall:.3f} s wall per step, {total:.3f} s of op time per "
        f"step, of which collectives {collective:.3f} s; {waited:.3f} s waiting at collectives' "
        f"rendezvous (load average {os.getloadavg()[0]:.2f})")
  print("| s per step | share | op | category | output | fused jax operations |\n|---|---|---|---|---|---|")
  for name, s in times.most_common(args.top or 40):
    shape, ops = shapes.get(name, ("?", ""))
    print(f"| {s:.4f} | {100 * s / total:.1f} % | {name} | {category(name, info.get(name))} | `{shape}` "
          f"| {ops[:90]} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
