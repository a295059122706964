"""The Markdown of benchmarks/tpu_suite.sh, from the files its stages left in one folder: the tests'
log (tests.log), the start-up runs (startup_cold.log, startup_warm.log), MaxText's rows (maxtext_*.json, tpu_rows.py) and
our step matrix (ours.json, tpu_step.py). Missing or failed parts are said, not left out.

  python3 benchmarks/tpu_report.py --dir OUT --commit HASH --seconds N > OUT/tpu_suite.md
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import re
import sys


def _read(path: str) -> str:
  try:
    with open(path, encoding="utf-8", errors="replace") as f:
      return f.read()
  except OSError:
    return ""


def tests_section(text: str) -> list[str]:
  if not text:
    return ["tests: no log (the stage did not run)"]
  summary = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
  results = [ln for ln in text.splitlines() if ln.startswith(("PASSED", "FAILED", "ERROR"))]
  lines = [f"tests (`tests/test_tpu.py`, marked `tpu`): **{summary[-1].strip('= ') if summary else 'no summary'}**", ""]
  lines += [f"- {ln}" for ln in results]
  failures = re.findall(r"^E\s+(AssertionError.*)$", text, re.M)
  lines += [f"  - {f[:300]}" for f in failures[:8]]
  return lines


def measured_section(text: str) -> list[str]:
  """The tests' measurements (tests.jsonl: written before each assertion)."""
  rows = []
  for line in text.splitlines():
    try:
      rows.append(json.loads(line))
    except json.JSONDecodeError:
      continue
  if not rows:
    return []
  out = ["", "| measured by the `tpu` tests | values |", "|---|---|"]
  for r in rows:
    name = r.pop("test")
    out.append(f"| {name} | `{json.dumps(r)[:400]}` |")
  return out


def startup_section(text: str, phase: str = "cold") -> list[str]:
  line = next((ln for ln in text.splitlines() if ln.startswith("start-up")), None)
  step = [ln for ln in text.splitlines() if re.match(r"step +\d+/", ln)]
  if line is None:
    return [f"start-up (Qwen3-0.6B, {phase}): no start-up line; the log's tail:", "```",
            *text.splitlines()[-8:], "```"]
  return [f"start-up (`train.py`, Qwen3-0.6B seq 2048 batch 8, remat full, {phase} compile cache): "
          f"`{line}`", *([f"last step: `{step[-1]}`"] if step else [])]


def maxtext_rows(folder: str) -> list[dict]:
  rows = []
  for path in sorted(glob.glob(os.path.join(folder, "maxtext_*.json"))):
    text = _read(path).strip()
    try:
      rec = json.loads(text.splitlines()[-1]) if text else {}
    except json.JSONDecodeError:
      rec = {}
    rec["file"] = os.path.basename(path)
    rows.append(rec)
  return rows


def _fmt(x, spec: str, none: str = "–") -> str:
  return none if x is None else format(x, spec)


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--dir", required=True)
  ap.add_argument("--commit", default="unknown")
  ap.add_argument("--seconds", type=int, default=0)
  args = ap.parse_args()
  d = args.dir
  env = _read(os.path.join(d, "env.txt")).strip()
  out = [f"### TPU lane: `benchmarks/tpu_suite.sh` at {args.commit}, "
         f"{datetime.date.today().isoformat()}{', ' + env if env else ''} ({args.seconds} s)", ""]
  out += tests_section(_read(os.path.join(d, "tests.log")))
  out += measured_section(_read(os.path.join(d, "tests.jsonl"))) + [""]
  for phase in ("cold", "warm"):
    out += startup_section(_read(os.path.join(d, f"startup_{phase}.log")), phase) + [""]
  mt = maxtext_rows(d)
  ours = json.loads(_read(os.path.join(d, "ours.json")) or "[]")
  out += ["| trainer, row | tokens/s | MFU (of 197 TFLOP/s) | s/step | pre-flight est. GiB | "
          "XLA's count GiB | init s | compile s | vs MaxText's full-remat row |",
          "|---|---|---|---|---|---|---|---|---|"]
  base = next((r.get("tokens_per_s_per_device") for r in mt if r.get("file") == "maxtext_full.json"
               and r.get("exit_status") == 0), None)
  for r in mt:
    ok = r.get("exit_status") == 0 and r.get("tokens_per_s_per_device")
    name = r["file"].removesuffix(".json").replace("maxtext_", "MaxText 0.2.5, ")
    if not ok:
      tail = (r.get("log_tail") or r.get("error") or "no record")
      tail = str(tail).strip().splitlines()[-1][:160] if str(tail).strip() else "no record"
      out.append(f"| {name} | failed (exit {r.get('exit_status')}): {tail} | | | | | | | |")
      continue
    out.append(f"| {name} | {r['tokens_per_s_per_device']:,.0f} | {_fmt(r.get('mfu'), '.1%')} | "
               f"{_fmt(r.get('step_time_s'), '.3f')} | | | | | "
               f"{_fmt(r['tokens_per_s_per_device'] / base if base else None, '.3f')}× |")
  for r in ours:
    if r.get("status") != "ok":
      out.append(f"| ours, {r.get('label')} | {r.get('status')}: {str(r.get('error', ''))[:160]} "
                 f"| | | {_fmt(r.get('estimate_gib'), '.2f')} | {_fmt(r.get('compiled_gib'), '.2f')} "
                 f"| | | |")
      continue
    out.append(f"| ours, {r['label']} | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | "
               f"{r['step_s']:.3f} | {r['estimate_gib']:.2f} ({r['preflight']}) | "
               f"{_fmt(r.get('compiled_gib'), '.2f')} | {r['init_s']:.1f} | {r['compile_s']:.1f} | "
               f"{_fmt(r['tokens_per_s'] / base if base else None, '.3f')}× |")
  out += ["", "Rows: Qwen3-0.6B, seq 2048, synthetic data, bf16 compute, one v5e chip, splash "
          "blocks 1024 with the fused backward on both sides; MFU in MaxText's accounting (both "
          "count the same TFLOP per step). Raw: tests.log, startup_cold.log, startup_warm.log, maxtext_*.json/.log, "
          "ours.json/.log."]
  print("\n".join(out))
  return 0


if __name__ == "__main__":
  sys.exit(main())
