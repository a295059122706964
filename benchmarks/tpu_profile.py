"""Where each trainer's step spends the chip's time, side by side: our `train.py` and MaxText 0.2.5
(the arm of benchmarks/tpu_install.sh) each run a few steps with its own profiler
(`profiler=xplane skip_first_n_steps_for_profiler=N profiler_steps=K`, the same keys on both
sides) and its step program's optimized HLO dumped; the XSpace trace is read with
`jax.profiler.ProfileData` (MaxText/metrics/profiler.py: each op's own time on the device, per
step), each op named by its HLO instruction and the jax operation it came from.

  python3 benchmarks/tpu_profile.py ours    --out ours.json    [--top 40] key=value ...
  python3 benchmarks/tpu_profile.py maxtext --out maxtext.json [--top 40] key=value ...
  python3 benchmarks/tpu_profile.py compare ours.json maxtext.json > side_by_side.md
  python3 benchmarks/tpu_profile.py summary RUN_DIR/profile [--hlo-dir DIR]   # any trace

The JSON: the step's time, the categories (ms per step), the top ops (ms per step, runs per step,
FLOP rate where the trace carries it, HLO, jax operation) and the row's throughput (tpu_rows.py's
record of the same run, whose medians include the traced steps). `compare` prints both sides'
categories and a table of ops grouped by jax operation (what the program does, whatever the HLO
names), biggest difference first.
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
from typing import Any, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from MaxText.metrics import profiler  # noqa: E402

PROFILE_KEYS = {"profiler": "xplane", "skip_first_n_steps_for_profiler": "5",
                "profiler_steps": "3", "steps": "9"}
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def step_hlo_files(files: list[str]) -> list[str]:
  """The largest of a module's dumped HLO files: the step itself (not a helper program)."""
  return sorted(files, key=os.path.getsize)[-1:]


def hlo_instructions(hlo_dir: str, module: str) -> dict[str, tuple[str, str]]:
  """{instruction name: (its HLO text, its jax operation)} of the optimized HLO dumped for
  `module` (the trace's step program; `--xla_dump_to`'s `*after_optimizations*.txt`)."""
  stem = module.split("(")[0]
  files = [f for f in glob.glob(os.path.join(hlo_dir, "*after_optimizations*.txt"))
           if stem and f".{stem}." in os.path.basename(f)]
  out: dict[str, tuple[str, str]] = {}
  for path in step_hlo_files(files):
    with open(path, encoding="utf-8", errors="replace") as f:
      for line in f:
        m = _INSTR.match(line)
        if m:
          op = _OP_NAME.search(line)
          out[m.group(1)] = (m.group(2)[:300], op.group(1) if op else "")
  return out


def jax_op(source: str) -> str:
  """A jax operation name with its jit and transformation wrappers cut, e.g.
  `jit(step)/transpose(jvp())/while/body/closed_call/checkpoint/dot_general` →
  `bwd:loop/dot_general`: `bwd:` under a transpose (the backward pass), `loop/` inside a while
  loop (the layer scan, a chunk loop), `recompute/` in a rematerialized computation."""
  if not source:
    return ""
  prefix = ("bwd:" if "transpose(" in source else "") + ("loop/" if "/while/" in source else "") \
      + ("recompute/" if "rematted_computation" in source else "")
  parts = [p for p in source.split("/") if p and not p.startswith(("jit(step", "jit(train_step",
                                                                    "pjit(", "jvp(", "transpose("))]
  keep = [p for p in parts if p not in ("while", "body", "cond", "closed_call", "core_call",
                                        "checkpoint", "rematted_computation", "remat", "jvp()")]
  return prefix + "/".join(keep[-3:])


def _shape(hlo: str) -> str:
  m = re.match(r"\(?([a-z0-9]+\[[0-9,]*\])", hlo)
  return m.group(1) if m else ""


def summarize_dir(profile_dir: str, hlo_dir: str | None, top: int) -> dict[str, Any]:
  files = profiler.xplane_files(profile_dir)
  if not files:
    raise FileNotFoundError(f"no *{profiler.XPLANE_SUFFIX} under {profile_dir}")
  summaries = profiler.summarize(files[-1])
  if not summaries:
    raise ValueError(f"{files[-1]}: no device plane")
  s = summaries[0]
  hlo = hlo_instructions(hlo_dir, s.step_module) if hlo_dir else {}
  per = max(s.steps, 1)
  ops = []
  for op in s.ops:
    text, source = hlo.get(op.name, (op.text, op.source))
    ops.append({"name": op.name, "category": op.category, "ms": op.ns / per / 1e6,
                "runs": op.count / per,
                "tflops": op.flops * op.count / op.ns / 1e3 if op.flops and op.ns else None,
                "hlo": (text or op.text)[:240], "jax_op": jax_op(source or op.source)})
  by_op: collections.Counter = collections.Counter()
  by_runs: collections.Counter = collections.Counter()   # 28 a step: once per layer, ...
  for o in ops:
    by_runs[f"{o['runs']:g}"] += o["ms"]
    by_op[f"{o['jax_op'] or o['category']} {_shape(o['hlo'])}".strip()] += o["ms"]
  return {"xplane": files[-1], "device": s.device, "steps_traced": s.steps,
          "step_module": s.step_module, "step_ms": s.step_ns / 1e6,
          "ops_ms": sum(o["ms"] for o in ops),
          "categories_ms": {k: v / 1e6 for k, v in s.categories().items()},
          "by_jax_op_ms": dict(by_op.most_common()), "by_runs_per_step_ms": dict(by_runs.most_common()),
          "top_ops": ops[:top],
          "hlo_matched": sum(1 for op in s.ops if op.name in hlo)}


def run_side(trainer: str, keys: Sequence[str], work: str, top: int,
             timeout_s: float | None, hlo_out: str = "") -> dict[str, Any]:
  import tpu_rows  # pylint: disable=import-outside-toplevel
  os.makedirs(work, exist_ok=True)
  hlo_dir = os.path.join(work, "hlo")
  flags = (f"--xla_dump_to={hlo_dir} --xla_dump_hlo_as_text "
           "--xla_dump_hlo_module_re=.*step.*")
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flags).strip()
  merged = tpu_rows.merge_keys(PROFILE_KEYS, keys)
  steps = int(dict(k.split("=", 1) for k in merged)["steps"])
  row = (tpu_rows.ours_row if trainer == "ours" else tpu_rows.maxtext_row)(
      merged, steps=steps, warmup=min(5, steps - 1), timeout_s=timeout_s, work=work)
  rec: dict[str, Any] = {"trainer": trainer, "keys": list(keys), "row": row}
  try:
    rec.update(summarize_dir(work, hlo_dir, top))
  except (FileNotFoundError, ValueError) as e:
    rec["error"] = str(e)
  if hlo_out and rec.get("step_module"):   # the step's optimized HLO, compressed, for reading
    stem = rec["step_module"].split("(")[0]
    files = [f for f in glob.glob(os.path.join(hlo_dir, "*after_optimizations*.txt"))
             if f".{stem}." in os.path.basename(f)]
    for path in step_hlo_files(files):
      with open(path, "rb") as src, gzip.open(hlo_out, "wb") as dst:
        dst.write(src.read())
      rec["hlo_file"] = hlo_out
  return rec


def markdown(rec: dict[str, Any], top: int) -> str:
  row = rec.get("row", {})
  head = (f"**{rec.get('trainer', '')}** `{' '.join(rec.get('keys', []))}`: "
          f"{rec.get('step_ms', 0):.1f} ms per traced step (ops {rec.get('ops_ms', 0):.1f}); "
          f"row: {row.get('tokens_per_s', 0) or 0:,.0f} tok/s, MFU {row.get('mfu') or 0:.1%}")
  lines = [head, "", "| category | ms / step |", "|---|---|"]
  lines += [f"| {k} | {v:.2f} |" for k, v in rec.get("categories_ms", {}).items()]
  lines += ["", "| op | category | ms / step | runs | TFLOP/s | jax op | HLO |", "|" + "---|" * 7]
  for o in rec.get("top_ops", [])[:top]:
    rate = f"{o['tflops']:.0f}" if o.get("tflops") else ""
    lines.append(f"| {o['name']} | {o['category']} | {o['ms']:.3f} | {o['runs']:g} | {rate} | "
                 f"{o['jax_op'][:80]} | {o['hlo'][:140].replace('|', '/')} |")
  return "\n".join(lines)


def compare(a: dict[str, Any], b: dict[str, Any], top: int) -> str:
  names = (a.get("trainer", "a"), b.get("trainer", "b"))
  out = [f"| | {names[0]} | {names[1]} |", "|---|---|---|",
         f"| ms per traced step | {a.get('step_ms', 0):.1f} | {b.get('step_ms', 0):.1f} |",
         f"| ops' own ms | {a.get('ops_ms', 0):.1f} | {b.get('ops_ms', 0):.1f} |"]
  cats = list(dict.fromkeys([*a.get("categories_ms", {}), *b.get("categories_ms", {})]))
  for c in cats:
    out.append(f"| {c} | {a.get('categories_ms', {}).get(c, 0):.2f} | "
               f"{b.get('categories_ms', {}).get(c, 0):.2f} |")
  out += ["", f"| jax operation ({names[0]}) | ms | | jax operation ({names[1]}) | ms |",
          "|---|---|---|---|---|"]
  ia = list(a.get("by_jax_op_ms", {}).items())[:top]
  ib = list(b.get("by_jax_op_ms", {}).items())[:top]
  for i in range(max(len(ia), len(ib))):
    left = ia[i] if i < len(ia) else ("", 0.0)
    right = ib[i] if i < len(ib) else ("", 0.0)
    out.append(f"| {left[0][:70]} | {left[1]:.2f} | | {right[0][:70]} | {right[1]:.2f} |")
  return "\n".join(out)


def main(argv: Sequence[str]) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("what", choices=("ours", "maxtext", "compare", "summary"))
  ap.add_argument("args", nargs="*", help="key=value (ours, maxtext); two JSON files (compare); "
                  "a profile directory (summary)")
  ap.add_argument("--out", default="", help="ours / maxtext: write the record as JSON here")
  ap.add_argument("--work", default="", help="ours / maxtext: the run directory (kept)")
  ap.add_argument("--hlo-dir", default="", help="summary: a --xla_dump_to directory")
  ap.add_argument("--top", type=int, default=40, help="ops kept in the JSON / shown")
  ap.add_argument("--timeout", type=float, default=None)
  args = ap.parse_intermixed_args(argv)
  if args.what == "compare":
    if len(args.args) != 2:
      ap.error("compare takes two JSON files")
    with open(args.args[0], encoding="utf-8") as f:
      a = json.load(f)
    with open(args.args[1], encoding="utf-8") as f:
      b = json.load(f)
    print(compare(a, b, args.top))
    return 0
  if args.what == "summary":
    if len(args.args) != 1:
      ap.error("summary takes one profile directory")
    try:
      rec = summarize_dir(args.args[0], args.hlo_dir or None, args.top)
    except (FileNotFoundError, ValueError) as e:
      print(f"tpu_profile: {e}", file=sys.stderr)
      return 2
    print(markdown(rec, args.top))
    return 0
  bad = [k for k in args.args if "=" not in k]
  if bad:
    ap.error(f"not key=value: {' '.join(bad)}")
  work = args.work or os.path.join("/tmp", f"tpu_profile_{args.what}")
  rec = run_side(args.what, args.args, work, args.top, args.timeout,
                 hlo_out=args.out[:-len(".json")] + ".hlo.txt.gz" if args.out.endswith(".json")
                 else "")
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      json.dump(rec, f, indent=1)
  print(markdown(rec, args.top))
  return 0 if "error" not in rec and rec["row"].get("exit_status") == 0 else 1


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
