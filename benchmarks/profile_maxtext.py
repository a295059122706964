"""MaxText's train step profiled the way `profile_step.py --categories` profiles ours: the same
reference tiny config (`tiny_train.py`'s MaxText command), XLA:CPU's per-op trace events
(`--xla_cpu_enable_xprof_traceme=true`) over 3 steps after 5, each op put in the same categories as
ours, read from MaxText's compiled HLO (its `--xla_dump_to` dump of `jit_train_step`).

  .venv/bin/python benchmarks/profile_step.py --devices 4 --categories --hlo /tmp/ours4.hlo   # ours
  .venv/bin/python benchmarks/profile_maxtext.py --maxtext-python /work/mt/venv/bin/python --devices 4 \
      --ours-hlo /tmp/ours4.hlo [--top 40] [--collectives] [--work DIR [--reuse]]

MaxText runs in its own venv and its own training loop (`maxtext.trainers.pre_train.train`), with
its profiler (`profiler=xplane`, `profile_cleanly`: the state is ready before the first traced
step and after the last); a bootstrap replaces `jax.profiler.start_trace` so the trace is also
written as perfetto JSON (python tracer off) and the process's CPU seconds are read at both ends.
Trace events that are not instructions of `jit_train_step` (its loop's host work and waits, e.g.
`np.asarray(jax.Array)`: reading the previous step's metrics) are listed apart, not counted as ops.

MaxText's HLO carries no module names (its op names are `jvp()/while/body/eval_jaxpr/dot_general`,
einsum specs, ...), so its ops are mapped by where they sit and by their shapes:
  layer scan (inside a while loop): dots whose jax operation is an attention einsum (`...->bkgts`,
    `bkgts,...`) or whose output has rank >= 5 ([b, k, g, t, s] scores, softmax) are the attention
    core; other dots are the weight matmuls, backward when under `transpose(jvp` and not in the
    `rematted_computation` (MaxText's full remat recomputes the forward inside the backward scan);
    dynamic-(update-)slices, copies, concatenates are the stacked buffers; the rest element-wise;
  outside: collectives (as in ours); gather / scatter-add: the embedding; `wrapped_broadcast`:
    zero-filled buffers; ops whose own name has no `jvp(` (gradient norm, clip, AdamW, metrics):
    the optimizer; rank >= 3 copies / transposes: copies (MaxText stores the stacked kernels with
    the layer axis second, `param_scan_axis=1`, and transposes them to and from the scan's axis);
    other forward / backward ops touching a vocabulary-sized dimension, or per-token / scalar
    ([B, S], []): the LM head and loss (MaxText has no chunk loop); the rest: other (final norm).
With more devices than cores op times exceed CPU time (threads descheduled inside ops): compare
shares, and the process's CPU seconds, not op seconds.
--ours-hlo: also the dot FLOP per device and step of both compiled steps by category (each dot's
output size x its contracted size x 2, loop bodies times their trip counts): the work each remat
policy and layout does, independent of the machine's load.
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import math
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import profile_step  # noqa: E402  (this folder's script)
from tiny_train import REF, maxtext_cmd  # noqa: E402

FIRST, STEPS = 5, profile_step.STEPS

# Runs inside MaxText's venv: the trace as perfetto JSON, the CPU seconds around it, then MaxText.
BOOT = r"""
import json, os, sys, time
import jax
out = os.environ["PROFILE_MAXTEXT_DIR"]
start, stop, marks = jax.profiler.start_trace, jax.profiler.stop_trace, {}
def cpu():
  t = os.times()
  return t.user + t.system
def start_trace(*_, **__):
  options = jax.profiler.ProfileOptions()
  options.python_tracer_level = 0
  start(os.path.join(out, "trace"), create_perfetto_trace=True, profiler_options=options)
  marks.update(cpu0=cpu(), wall0=time.perf_counter())
def stop_trace():
  marks.update(cpu1=cpu(), wall1=time.perf_counter(), load=os.getloadavg()[0])
  stop()
  with open(os.path.join(out, "marks.json"), "w") as f:
    json.dump(marks, f)
jax.profiler.start_trace, jax.profiler.stop_trace = start_trace, stop_trace
from absl import app
from maxtext.trainers.pre_train import train
sys.argv[0] = "train"
app.run(train.main)
"""

LAYER = "layer scan: "
MOVES = r"copy\.|copy$|wrapped_transpose|transpose_copy|copy_bitcast|bitcast_copy"   # pure moves
ATTENTION_SPEC = re.compile(r"bkgts|btkgd,bskd|->bkgts|->btkgd")


def instruction_lines(hlo: str) -> dict[str, str]:
  """instruction name → its whole line (with operand shapes), and the called computation's body."""
  bodies = {m.group(1): m.group(2)
            for m in re.finditer(r"^(?:ENTRY )?%?([\w.\-]+) \(.*?\{\n(.*?)\n\}", hlo, re.M | re.S)}
  out = {}
  for line in hlo.splitlines():
    m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ", line)
    if m:
      called = re.search(r"calls=%?([\w.\-]+)", line)
      out[m.group(1)] = line + ("\n" + bodies.get(called.group(1), "") if called else "")
  return out


def mt_category(name: str, info, text: str, vocab: int) -> str:
  """The category (the names of `profile_step.category`'s) of one of MaxText's ops."""
  if name.startswith(profile_step.COLLECTIVES + ("InvokeRendezvous",)):
    if info and info[0]:
      return LAYER + "collectives (kernel gathers, gradient all-reduce)"
    return "collectives outside the layer scan (loss, head, embedding, metrics)"
  if info is None:
    return "runtime (launch, arguments)"
  loop, opcode, shape, joined, last, rank = profile_step.op_parts(info)
  if "scatter-add" in last or "gather" in last or opcode in ("gather", "scatter"):
    return "embedding lookup and its gradient"
  if loop:
    if opcode in ("copy", "concatenate", "dynamic-update-slice", "dynamic-slice") or re.search(
        r"copy|concatenate|dynamic-update-slice|dynamic-slice|dynamic_slice|dynamic_update", name):
      return LAYER + "copies, concatenates, stacked buffers"
    is_dot = "dot_general" in last or any("->" in n for n in last) or opcode == "dot"
    if (is_dot and ATTENTION_SPEC.search(joined)) or rank >= 5:
      return LAYER + "attention core"
    if is_dot:
      backward = "transpose(jvp" in joined and "rematted_computation" not in joined
      return LAYER + f"weight matmuls, {'backward' if backward else 'forward (and remat)'}"
    return LAYER + "element-wise (norms, RoPE, SiLU, converts)"
  if name.startswith("wrapped_broadcast"):
    return "zero-filled buffers (scan outputs, gradients)"
  own = re.search(r'op_name="([^"]+)"', text.split("\n", 1)[0])   # the op's own name, not its body's
  if "jvp(" not in (own.group(1) if own else joined):
    if opcode == "copy" or re.match(MOVES, name):
      return "copies outside the loops"
    return "optimizer (clip, AdamW, non-finite guard)"
  if rank >= 3 and (opcode in ("copy", "transpose") or re.match(MOVES, name)):
    return "copies outside the loops"   # MaxText: the stacked kernels to / from the scan axis
  if (re.search(rf"\[(?:[\d,]*,)?{vocab}(?:,[\d,]*)?\]", text) or "one_hot" in joined
      or rank <= 2 and not shape.startswith(("f32[256", "bf16[256"))):   # per-token statistics, sums
    return "loss + LM head (logits, cross-entropy)"
  return "other (final norm, embedding scale, ...)"


_DOT = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = \w+\[([\d,]*)\]\S* dot\(%?([\w.\-]+), "
                  r".*?lhs_contracting_dims=\{([\d,]*)\}", re.M)
_SHAPE = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = \w+\[([\d,]*)\]", re.M)


def _dots(body: str) -> dict[str, float]:
  """dot name → its FLOP (2 x output size x contracted size), for the dots written in `body`."""
  shapes, out = dict(_SHAPE.findall(body)), {}
  for name, dims, lhs, contracting in _DOT.findall(body):
    lhs_dims = shapes.get(lhs, "").split(",")
    out[name] = 2.0 * math.prod(int(d) for d in dims.split(",") if d) * math.prod(
        int(lhs_dims[int(c)]) for c in contracting.split(",") if c)
  return out


def dot_flops(hlo: str) -> dict[str, float]:
  """Scheduled instruction name → FLOP of the dots it runs per step on one device (itself, or its
  fused computation's dots), times the trip counts of the loops it sits in."""
  comps = {m.group(1): m.group(2)
           for m in re.finditer(r"^(?:ENTRY )?%?([\w.\-]+) \(.*?\{\n(.*?)\n\}", hlo, re.M | re.S)}
  trips, parent = {}, {}
  for comp, body in comps.items():
    for m in re.finditer(r"body=%?([\w.\-]+).*?known_trip_count\":\{\"n\":\"(\d+)", body):
      trips[m.group(1)], parent[m.group(1)] = int(m.group(2)), comp

  def times(comp: str) -> int:
    return trips[comp] * times(parent[comp]) if comp in trips else 1

  def flops(comp: str, seen: tuple = ()) -> float:   # a computation's dots and those of what it calls
    calls = set(re.findall(r"calls=%?([\w.\-]+)", comps.get(comp, ""))) - set(seen)
    return sum(_dots(comps.get(comp, "")).values()) + sum(flops(c, seen + (comp,)) for c in calls)

  out = {}
  for comp in [c for c in comps if c.startswith("main") or c in trips]:
    direct = _dots(comps[comp])
    for line in comps[comp].splitlines():
      m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ", line)
      called = re.search(r"calls=%?([\w.\-]+)", line)
      f = (flops(called.group(1)) if called else direct.get(m.group(1), 0.0)) if m else 0.0
      if f:
        out[m.group(1)] = f * times(comp)
  return out


def run_maxtext(python: str, n: int, mesh: str, dtype: str, work: str) -> str:
  """Runs MaxText with the trace and the dump; returns its log's path."""
  cell = {"devices": n, "mesh": mesh, "dtype": dtype}
  cmd = maxtext_cmd(python, work, "mt", cell, FIRST + STEPS + 2)
  assert cmd[1:3] == ["-m", "maxtext.trainers.pre_train.train"], cmd[:3]
  cmd = [python, "-c", BOOT, *cmd[3:], "profiler=xplane", f"skip_first_n_steps_for_profiler={FIRST}",
         f"profiler_steps={STEPS}", "profile_cleanly=true"]
  env = dict(os.environ, JAX_PLATFORMS="cpu", DECOUPLE_GCLOUD="TRUE", PROFILE_MAXTEXT_DIR=work,
             XLA_FLAGS=f"--xla_force_host_platform_device_count={n} "
                       f"--xla_cpu_enable_xprof_traceme=true --xla_dump_to={work}/dump "
                       "--xla_dump_hlo_module_re=jit_train_step")
  log = os.path.join(work, "maxtext.log")
  with open(log, "w") as f:
    code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, check=False).returncode
  if code != 0:
    raise SystemExit(f"MaxText exited {code}; see {log}")
  return log


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--maxtext-python", required=True)
  ap.add_argument("--devices", type=int, default=4)
  ap.add_argument("--mesh", default="fsdp", choices=("fsdp", "data"))
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--top", type=int, default=0, help="also the N largest ops")
  ap.add_argument("--work", default="", help="work directory (default: a temporary one); with "
                  "--reuse, read the trace and dump already there instead of running MaxText")
  ap.add_argument("--reuse", action="store_true")
  ap.add_argument("--collectives", action="store_true", help="also list MaxText's collectives")
  ap.add_argument("--ours-hlo", default="", metavar="FILE", help="our compiled step's HLO "
                  "(`profile_step.py --hlo FILE`, same devices and mesh): dot FLOP side by side")
  args = ap.parse_args()
  work = os.path.abspath(args.work) if args.work else tempfile.mkdtemp(prefix="profile_maxtext_")
  os.makedirs(work, exist_ok=True)
  if not args.reuse:
    run_maxtext(args.maxtext_python, args.devices, args.mesh, args.dtype, work)
  dumps = sorted(glob.glob(f"{work}/dump/*jit_train_step*after_optimizations.txt"))
  if not dumps:
    raise SystemExit(f"no jit_train_step dump under {work}/dump")
  hlo = open(dumps[-1]).read()
  marks = json.load(open(os.path.join(work, "marks.json")))
  times, waited = profile_step.op_times(os.path.join(work, "trace"))
  info, lines = profile_step.op_info(hlo), instruction_lines(hlo)
  by, host = collections.Counter(), collections.Counter()
  for name, s in times.items():
    if info.get(name) is None and not name.startswith(profile_step.COLLECTIVES + ("InvokeRendezvous",)):
      host[name] += s   # not an op of the step: its loop's host work and waits (np.asarray: the metrics)
      continue
    by[mt_category(name, info.get(name), lines.get(name, ""), REF["vocab_size"])] += s
  total, cpu = sum(by.values()), (marks["cpu1"] - marks["cpu0"]) / STEPS
  print(f"MaxText, {args.devices} device(s) {args.mesh}, {args.dtype} (load average "
        f"{marks['load']:.2f}); {waited:.3f} s per step waiting at collectives' rendezvous")
  print(f"process CPU per step (traced) {cpu:.3f} s, wall {(marks['wall1'] - marks['wall0']) / STEPS:.3f} s, "
        f"op time {total:.3f} s  (dump {os.path.basename(dumps[-1])})")
  print("| category | op s per step | share |\n|---|---|---|")
  for name, s in by.most_common():
    print(f"| {name} | {s:.4f} | {100 * s / total:.1f} % |")
  if host:
    print("not counted (host events of MaxText's loop, not ops of the step), s per step: "
          + ", ".join(f"{k} {v:.4f}" for k, v in host.most_common(8)))
  flops = collections.Counter()
  for name, f in dot_flops(hlo).items():
    flops[("MaxText", mt_category(name, info.get(name), lines.get(name, ""), REF["vocab_size"]))] += f
  if args.ours_hlo:
    ours = open(args.ours_hlo).read()
    ours_info = profile_step.op_info(ours)
    for name, f in dot_flops(ours).items():
      flops[("ours", profile_step.category(name, ours_info.get(name)))] += f
  print("dot GFLOP per device and step, from the compiled HLO (loops times their trip counts):")
  print("| category | MaxText | ours |\n|---|---|---|")
  for cat in sorted({c for _, c in flops}, key=lambda c: -flops[("MaxText", c)] - flops[("ours", c)]):
    print(f"| {cat} | {flops[('MaxText', cat)] / 1e9:.2f} | "
          f"{flops[('ours', cat)] / 1e9 if args.ours_hlo else float('nan'):.2f} |")
  print(f"| all dots | {sum(v for (k, _), v in flops.items() if k == 'MaxText') / 1e9:.2f} | "
        f"{sum(v for (k, _), v in flops.items() if k == 'ours') / 1e9:.2f} |")
  if args.collectives:
    profile_step.print_collectives(profile_step.collectives(hlo), args.devices, args.dtype)
  if args.top:
    shapes = profile_step.describe(hlo)
    print("| s per step | share | op | category | output | fused jax operations |\n|---|---|---|---|---|---|")
    for name, s in [(k, v) for k, v in times.most_common() if k not in host][:args.top]:
      shape, ops = shapes.get(name, ("?", ""))
      cat = mt_category(name, info.get(name), lines.get(name, ""), REF["vocab_size"])
      print(f"| {s:.4f} | {100 * s / total:.1f} % | {name} | {cat} | `{shape}` | {ops[:80]} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
