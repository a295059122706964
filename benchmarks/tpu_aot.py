"""The train step compiled for a TPU v5e on THIS machine's CPU, no chip: libtpu's deviceless
(ahead-of-time) compile for a `v5e:1x1` topology, so the program is the one the chip would run
(same compiler, same fusions, same buffer assignment). Per variant: our memory pre-flight's
estimate against XLA's `memory_analysis()` of that program (the pre-flight's error, the figure
the TPU lane checks on the chip), the compile time, and the program's largest operations by XLA's
own cost model (`estimated_cycles`; a guide to fusion structure, not a timing: element-wise
fusions are estimated ~2-5x slower than they run). Device time is scarce; this costs none.

  bash benchmarks/tpu_aot.sh --base "model_name=qwen3-tiny max_target_length=256 dataset_type=synthetic" --variant "full: remat_policy=full" --top 3

(`tpu_aot.sh` downloads the libtpu wheel that matches the installed jax once, into
.libtpu-aot/, and runs this file with it.) Writes one Markdown table; --hlo-dir keeps each
variant's compiled HLO; --out the rows as JSON; --top N lists each variant's N costliest ops.

How: `jax.experimental.topologies.get_topology_desc("v5e:1x1", "tpu")` gives TPU device objects
that compile but cannot run; the Trainer is built on them and `compile_step()` lowers the step for
them. Our layers choose their platform path from `jax.default_backend()` (splash attention, the
plain hot path, the init generator), which is still "cpu" here, so this tool reports "tpu" for
the compile (only in this process).
"""
from __future__ import annotations

import json
import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
GiB = 2**30
TOPOLOGY = "v5e:1x1"


def tpu_devices():
  """The v5e chip's device objects (compile-only), or SystemExit naming what is missing."""
  if not os.environ.get("TPU_LIBRARY_PATH"):
    raise SystemExit("tpu_aot: TPU_LIBRARY_PATH is not set (run it through benchmarks/tpu_aot.sh)")
  # libtpu asks the (absent) TPU VM's metadata for these; a single-chip v5e answers them here
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-1")
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  import jax  # pylint: disable=import-outside-toplevel
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  topo = topologies.get_topology_desc(topology_name=TOPOLOGY, platform="tpu",
                                      chips_per_host_bounds=(1, 1, 1), num_slices=1)
  jax.default_backend = lambda: "tpu"   # the layers' platform choices (module docstring)
  return list(topo.devices)


_OP = re.compile(r'\s*(?:ROOT )?%([\w.\-]+) = (\(.*?\)|\S+) [\w-]+\(.*?"estimated_cycles":"(\d+)"')


def costliest_ops(hlo: str, n: int) -> list[dict]:
  """The program's n costliest instructions by XLA's estimated cycles (each loop body once)."""
  ops = []
  for line in hlo.splitlines():
    m = _OP.match(line)
    if m:
      name = re.search(r'op_name="([^"]*)"', line)
      ops.append({"op": m.group(1), "shape": m.group(2)[:80], "kcycles": int(m.group(3)) / 1e3,
                  "jax_op": name.group(1) if name else ""})
  return sorted(ops, key=lambda o: -o["kcycles"])[:n]


_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{\s*$")
_WHILE = re.compile(r" while\(.*condition=%([\w.\-]+), body=%([\w.\-]+)")
_CALL = re.compile(r" call\(.*to_apply=%([\w.\-]+)")


def program_cycles(hlo: str) -> float:
  """XLA's estimated cycles over the whole program as it runs: each instruction of the entry
  once, a while loop's body once per trip (its trip count: the largest integer constant its
  condition compares with — a scan's length), a called computation once per call; a
  conditional's branches not at all (which one runs is a value at run time). Fused computations
  are counted by their fusion instruction only. A guide to where the step's time goes (the
  per-op caveats of `costliest_ops` apply), not a timing."""
  computations: dict[str, list[str]] = {}
  entry, current = None, None
  for line in hlo.splitlines():
    m = _COMPUTATION.match(line)
    if m:
      current = m.group(1)
      computations[current] = []
      entry = current if line.startswith("ENTRY") else entry
    elif current is not None and line.startswith("  "):
      computations[current].append(line)
  total, todo = 0.0, [(entry, 1)] if entry else []
  while todo:
    name, times = todo.pop()
    for line in computations.get(name, []):
      cycles = re.search(r'"estimated_cycles":"(\d+)"', line)
      if cycles:
        total += times * int(cycles.group(1))
      loop = _WHILE.search(line)
      if loop:
        trips = [int(c) for c in re.findall(r"constant\((\d+)\)",
                                            "\n".join(computations.get(loop.group(1), [])))]
        todo.append((loop.group(2), times * max(trips, default=1)))
      call = _CALL.search(line)
      if call:
        todo.append((call.group(1), times))
  return total


def run_variant(label: str, argv: list[str], devices, hlo_dir: str, top: int) -> dict:
  from MaxText.config.load import load_config  # pylint: disable=import-outside-toplevel
  from MaxText.train import memory  # pylint: disable=import-outside-toplevel
  from MaxText.train.loop import Trainer  # pylint: disable=import-outside-toplevel
  cfg = load_config([os.path.join(ROOT, "configs/base.yml"), "jax_cache_dir=",
                     "base_output_directory=/tmp/tpu_aot", "run_name=tpu_aot", *argv],
                    keep_auto=True)
  trainer = Trainer(cfg, devices)
  est = trainer.memory_estimate()
  row = {"label": label, "keys": " ".join(argv), "remat": trainer.cfg.remat_policy,
         "estimate_gib": est.needed / GiB, "runtime_gib": est.runtime / GiB}
  t0 = time.perf_counter()
  try:
    compiled = trainer.compile_step()
  except Exception as e:  # noqa: BLE001 — a program that does not fit is a result
    row.update(status="compile failed", error=str(e).splitlines()[0][:300])
    return row
  row["compile_s"] = time.perf_counter() - t0
  compiled_bytes = memory.compiled_step_bytes(compiled)
  if compiled_bytes is not None:
    row["compiled_plus_runtime_gib"] = (compiled_bytes + est.runtime) / GiB
    row["error"] = (est.needed - compiled_bytes - est.runtime) / (compiled_bytes + est.runtime)
  hlo = compiled.as_text()
  if hlo_dir:
    os.makedirs(hlo_dir, exist_ok=True)
    path = os.path.join(hlo_dir, re.sub(r"\W+", "_", label).strip("_") + ".hlo.txt")
    with open(path, "w", encoding="utf-8") as f:
      f.write(hlo)
  row.update(status="ok", program_mcycles=program_cycles(hlo) / 1e6,
             top_ops=costliest_ops(hlo, top))
  return row


def table(rows: list[dict]) -> str:
  out = ["| variant | remat | pre-flight est. GiB | XLA compiled + runtime GiB | est. error | "
         "compile s | est. Mcycles |", "|---|---|---|---|---|---|---|"]
  for r in rows:
    if r.get("status") != "ok":
      out.append(f"| {r['label']} | {r.get('remat', '')} | {r.get('estimate_gib', 0):.2f} | "
                 f"{r.get('status')}: {r.get('error', '')[:120]} | | | |")
      continue
    out.append(f"| {r['label']} | {r['remat']} | {r['estimate_gib']:.2f} | "
               f"{r['compiled_plus_runtime_gib']:.2f} | {r['error']:+.1%} | {r['compile_s']:.0f} | "
               f"{r['program_mcycles']:.1f} |")
  return "\n".join(out)


def emit(row: dict, rows: list, out: str, op_line) -> None:
  """`row` added to `rows`: printed as one JSON line (without its ops), then its ops each as
  `op_line(op)`, and all rows written to `out` (when given) after each, so a cut run keeps them."""
  rows.append(row)
  print(json.dumps({k: v for k, v in row.items() if k != "top_ops"}), flush=True)
  for op in row.get("top_ops", []):
    print(op_line(op), flush=True)
  if out:
    with open(out, "w", encoding="utf-8") as f:
      json.dump(rows, f, indent=1)


def finish(rows: list, text: str) -> int:
  """Prints the rows' table `text`; the exit status: 0 when every row compiled."""
  print(text, flush=True)
  return 0 if all(r.get("status") == "ok" for r in rows) else 1


def main() -> int:
  from tpu_step import variant_parser, variants  # pylint: disable=import-outside-toplevel
  ap = variant_parser(__doc__)
  ap.add_argument("--hlo-dir", default="", help="keep each variant's compiled HLO here")
  ap.add_argument("--top", type=int, default=0, help="list each variant's N costliest ops")
  args = ap.parse_args()
  devices = tpu_devices()
  rows = []
  for label, argv in variants(args.base, args.variant):
    emit(run_variant(label, argv, devices, args.hlo_dir, args.top), rows, args.out,
         lambda op: f"    {op['kcycles']:9.0f}k cycles  {op['op']:36s} {op['shape'][:50]:50s} "
                    f"{op['jax_op'][-60:]}")
  return finish(rows, table(rows))


if __name__ == "__main__":
  sys.exit(main())
