"""Trains the reference tiny config with this trainer and with MaxText, side by side, over a matrix
of device counts, meshes and dtypes, and prints one table.

Reference config: d_model 256, 4 layers, 4 heads of 64, SwiGLU mlp 1024, vocab 8192, seq 256,
global batch 8 (per-device batch 8 / devices), synthetic data, fp32 master weights.

Matrix (every cell runs both trainers back to back, the cells interleaved, `--repeats` times (3 by
default), the order of the cells and of the trainers in a cell reversed on every other repetition,
so machine noise and load drift hit both alike; one process per run, and the same cell of the same
trainer spreads from one process to the next even on a quiet machine, which the [min–max] shows):
  devices   1, 2, 4 fake XLA:CPU devices (--xla_force_host_platform_device_count)
  mesh      fsdp: ici_fsdp_parallelism = devices;  data: ici_data_parallelism = 2 x fsdp = rest
            (one device: a single "-" row)
  dtype     float32, bfloat16 compute
Each trainer runs with its own defaults (ours: scan + save_matmuls remat; MaxText: scan + full
remat); `--as-mt` adds ours with MaxText's remat/scan settings. Per cell and trainer: tokens/s (each
run's median of steps >= --first-step; global, all devices) as the median over the repetitions and
their [min–max]; ours / MaxText as the ratio of those medians; CPU seconds per step; and how far
our losses are from our one-device run of the same dtype (max relative difference over the steps: the data and model are
the same; only the reduction order changes with the mesh).

  .venv/bin/python benchmarks/tiny_train.py --maxtext-python /path/to/maxtext-venv/bin/python
  .venv/bin/python benchmarks/tiny_train.py --devices 2 --meshes fsdp --dtypes bfloat16   # one cell

--default-run instead compares the README run (`train.py configs/base.yml`, nothing set: our
default model, data, dtype (bf16 compute) and one CPU device per core) with MaxText's best CPU
setup on the same model (vocabulary 384, seq 256, 8 sequences per device; 1 and 2 devices, fp32
and bf16), and ours on one device for reference.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REF = {"emb_dim": 256, "num_decoder_layers": 4, "num_query_heads": 4, "num_kv_heads": 4,
       "head_dim": 64, "mlp_dim": 1024, "vocab_size": 8192, "max_target_length": 256}
GLOBAL_BATCH = 8


README_MODEL = {**REF, "vocab_size": 384}   # configs/base.yml's own model


def mesh_keys(devices: int, mesh: str) -> dict[str, int]:
  """ici_* sizes (both trainers take the same keys)."""
  if mesh == "data":
    return {"ici_data_parallelism": 2, "ici_fsdp_parallelism": devices // 2}
  return {"ici_data_parallelism": 1, "ici_fsdp_parallelism": devices}


def ours_cmd(out: str, name: str, cell: dict, steps: int, extra: list[str]) -> list[str]:
  keys = [f"{k}={v}" for k, v in REF.items()] + [
      f"per_device_batch_size={GLOBAL_BATCH / cell['devices']:g}", "dataset_type=synthetic",
      f"steps={steps}", "enable_checkpointing=false", "enable_tensorboard=false", "jax_cache_dir=",
      f"dtype={cell['dtype']}", "weight_dtype=float32", f"base_output_directory={out}",
      f"run_name={name}", *(f"{k}={v}" for k, v in mesh_keys(cell["devices"], cell["mesh"]).items())]
  return [sys.executable, os.path.join(ROOT, "train.py"), os.path.join(ROOT, "configs/base.yml"),
          *keys, *extra]


def maxtext_cmd(python: str, out: str, name: str, cell: dict, steps: int,
                vocab: int = REF["vocab_size"], per_device_batch: int | None = None) -> list[str]:
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
          'mlp_activations=["silu","linear"]', f"vocab_size={vocab}", "max_target_length=256",
          f"per_device_batch_size={per_device_batch or GLOBAL_BATCH // cell['devices']}",
          f"dtype={cell['dtype']}",
          "weight_dtype=float32",
          *(f"{k}={v}" for k, v in mesh_keys(cell["devices"], cell["mesh"]).items())]


def _cpu_seconds(pid: int) -> float | None:
  """utime + stime of a live process (all its threads), from /proc."""
  try:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
      fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
  except (OSError, IndexError, ValueError):
    return None


def run(cmd: list[str], env: dict, log_path: str, metrics_path: str | None = None
        ) -> tuple[int, float, float, list[float]]:
  """Runs cmd; returns (exit status, peak RSS in GiB of that process, wall seconds, the process's
  CPU seconds when each row of `metrics_path` appeared). The CPU time a step costs barely depends
  on what else runs on the machine, unlike its wall time.

  A metrics file left by an earlier run of the same name (a reused --out) is removed first: its
  rows would count as this run's at once (and our trainer moves them aside when it starts), which
  left no per-row samples at all."""
  if metrics_path and os.path.exists(metrics_path):
    os.remove(metrics_path)
  start = time.perf_counter()
  cpu_at_rows: list[float] = []
  with open(log_path, "w") as log:
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    while True:
      pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
      if pid:
        break
      cpu = _cpu_seconds(proc.pid)
      rows = _rows(metrics_path)
      if cpu is not None:
        if rows < len(cpu_at_rows):   # the file was truncated or replaced: start again
          del cpu_at_rows[:]
        cpu_at_rows += [cpu] * (rows - len(cpu_at_rows))
      time.sleep(0.02)
  return (os.waitstatus_to_exitcode(status), usage.ru_maxrss / 2**20, time.perf_counter() - start,
          cpu_at_rows)


def _rows(metrics_path: str | None) -> int:
  """Complete lines of the metrics file so far (0 while it does not exist)."""
  try:
    with open(metrics_path, "rb") as f:
      return f.read().count(b"\n")
  except (OSError, TypeError):
    return 0


def cpu_per_step(cpu_at_rows: list[float], first: int) -> float | None:
  """CPU seconds per step from row `first` to the last row seen while the process ran: the
  process's CPU time between the two rows' appearance over the steps between them (rows that
  appear together, e.g. flushed at once, share one sample, so single-row deltas could be 0)."""
  if len(cpu_at_rows) < first + 2:
    return None
  spent = cpu_at_rows[-1] - cpu_at_rows[first]
  return spent / (len(cpu_at_rows) - 1 - first) if spent > 0 else None


def tokens_per_step(tokens_per_s: list[float], step_s: list[float]) -> int:
  """The tokens of one step, exactly: each row's tokens/s x its own step time (the same whole
  number in every row; the product of the two medians is not, e.g. 4,097)."""
  per_row = {round(t * s) for t, s in zip(tokens_per_s, step_s)}
  if len(per_row) != 1:
    raise ValueError(f"the rows disagree on the tokens per step: {sorted(per_row)}")
  return per_row.pop()


def summarise(kind: str, run_dir: str, first: int, devices: int) -> dict:
  rows = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl")) if l.strip()]
  if kind == "maxtext":  # its steps count from 0; per-device tokens/s
    sel = [r for r in rows if r["step"] >= first]
    tok = [devices * r["perf/per_device_tokens_per_sec"] for r in sel]
    step = [r["perf/step_time_seconds"] for r in sel]
    losses = [r["learning/loss"] for r in rows if "learning/loss" in r]
  else:
    sel = [r for r in rows if r["step"] > first]  # our steps count from 1
    tok, step = [r["tokens_per_s"] for r in sel], [r["step_time_s"] for r in sel]
    losses = [r["loss"] for r in rows]
  return {"tokens_per_s": statistics.median(tok), "step_s": statistics.median(step),
          "tokens_per_step": tokens_per_step(tok, step), "losses": losses}


def cells(devices: list[int], meshes: list[str], dtypes: list[str]) -> list[dict]:
  out = []
  for n in devices:
    for mesh in (["-"] if n == 1 else meshes):
      if mesh == "data" and n % 2:
        continue
      out += [{"devices": n, "mesh": mesh, "dtype": d} for d in dtypes]
  return out


def load() -> str:
  return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def run_order(items: list, rep: int) -> list:
  """Repetition `rep`'s order of the cells (or of the trainers in a cell): as given on even
  repetitions, reversed on odd ones, so every cell runs early and late in the matrix and every
  trainer first and second in its cell equally often over two repetitions (a drift of the
  machine's load, or whatever the previous process leaves warm, then hits both alike)."""
  return list(items) if rep % 2 == 0 else list(reversed(items))


def spread(values: list[float]) -> str:
  """"median [min–max]" of one trainer's repetitions of one cell (tokens/s)."""
  if len(values) == 1:
    return f"{values[0]:,.0f}"
  return f"{statistics.median(values):,.0f} [{min(values):,.0f}–{max(values):,.0f}]"


def matrix_table(matrix: list[dict], kinds: list[str], results: dict[tuple, list[dict]]
                 ) -> list[str]:
  """The matrix's markdown table: per cell and trainer the median tokens/s over the repetitions
  with their spread [min–max], the ratio of the medians (ours / MaxText), the CPU seconds per step
  (medians), and how far our losses are from our one-device run."""
  med = lambda rs, k: statistics.median(r[k] for r in rs)
  head = "| devices | mesh | dtype | repeats | " + " | ".join(
      f"{k} tok/s median [min–max]" for k in kinds)
  if "maxtext" in kinds:
    head += " | ours / MaxText (medians) | CPU-s per step ours / MaxText | MaxText / ours CPU time"
  lines = [head + " | our loss vs 1 device |", "|" + "---|" * (head.count("|") + 1)]
  for cell in matrix:
    key = (cell["devices"], cell["mesh"], cell["dtype"])
    line = (f"| {cell['devices']} | {cell['mesh']} | {cell['dtype']} | "
            f"{len(results[('ours', *key)])} | ")
    line += " | ".join(spread([r["tokens_per_s"] for r in results[(k, *key)]]) for k in kinds)
    if "maxtext" in kinds:
      ratio = med(results[("ours", *key)], "tokens_per_s") / med(results[("maxtext", *key)], "tokens_per_s")
      line += f" | **{ratio:.2f}x**"
      cpu = [[r["cpu_s"] for r in results[(k, *key)] if r["cpu_s"]] for k in ("ours", "maxtext")]
      if all(cpu):
        ours_cpu, mt_cpu = statistics.median(cpu[0]), statistics.median(cpu[1])
        line += f" | {ours_cpu:.2f} / {mt_cpu:.2f} | **{mt_cpu / ours_cpu:.2f}x**"
      else:
        line += " | n/a | n/a"
    one = results.get(("ours", 1, "-", cell["dtype"]))
    dev = "n/a"
    if one:
      a, b = one[0]["losses"], results[("ours", *key)][0]["losses"]
      dev = f"{max(abs(x - y) / abs(y) for x, y in zip(b, a)):.1e}"
    lines.append(line + f" | {dev} |")
  return lines


def default_run(args, out: str) -> int:
  """The README run vs MaxText's best CPU setup on the same model (see the module docstring)."""
  base_env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS",
                                                               "JAX_NUM_CPU_DEVICES")}
  runs = [("ours default (one device per core)", "ours", None, None),
          ("ours, 1 device", "ours", 1, None),
          ("ours, one device per core, float32", "ours", None, "float32")]
  if args.maxtext_python:
    runs += [(f"MaxText {n} device{'s' * (n > 1)} {d}", "maxtext", n, d)
             for n in (1, 2) for d in ("float32", "bfloat16")]
  results: dict[str, list[dict]] = {}
  print(f"{len(runs)} runs x {args.repeats} repeats; {load()}", flush=True)
  for rep in range(args.repeats):
    for label, kind, n, dtype in run_order(runs, rep):
      name = f"default-{label.split()[0]}-{n}-{dtype}-{rep}".replace(" ", "")
      keys = [f"steps={args.steps}", "enable_checkpointing=false", "enable_tensorboard=false",
              f"base_output_directory={out}", f"run_name={name}"]
      if kind == "ours":
        env = dict(base_env) if n is None else dict(base_env, JAX_NUM_CPU_DEVICES=str(n))
        cmd = [sys.executable, os.path.join(ROOT, "train.py"), os.path.join(ROOT, "configs/base.yml"),
               *keys, *([f"dtype={dtype}"] if dtype else [])]
      else:
        env = dict(base_env, JAX_PLATFORMS="cpu", DECOUPLE_GCLOUD="TRUE",
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={n}")
        cell = {"devices": n, "mesh": "fsdp", "dtype": dtype}
        cmd = maxtext_cmd(args.maxtext_python, out, name, cell, args.steps,
                          vocab=README_MODEL["vocab_size"], per_device_batch=GLOBAL_BATCH)
      code, _, _, cpu_rows = run(cmd, env, os.path.join(out, f"{name}.log"),
                                 os.path.join(out, name, "metrics.jsonl"))
      if code != 0:
        print(f"{label}: exit {code}; see {out}/{name}.log", file=sys.stderr)
        return 1
      s = summarise(kind, os.path.join(out, name), args.first_step, n or 1)
      s["cpu_s"] = cpu_per_step(cpu_rows, args.first_step)
      results.setdefault(label, []).append(s)
      print(f"  {label:40s} {s['tokens_per_s']:8,.0f} tok/s  {_cpu_text(s)}  ({load()})",
            flush=True)
  print(f"\n{load()}\n\n| run | tokens/s median [min–max] | CPU-s per step | tokens per step | CPU-s per 1k tokens |"
        "\n|---|---|---|---|---|")
  med: dict[str, float] = {}
  for label, rs in results.items():
    med[label] = statistics.median(r["tokens_per_s"] for r in rs)
    cpu = [r["cpu_s"] for r in rs if r["cpu_s"]]
    tokens, = {r["tokens_per_step"] for r in rs}   # exactly one value: each repeat's config
    per_k = f"{1000 * statistics.median(cpu) / tokens:.3f}" if cpu else "n/a"
    print(f"| {label} | {spread([r['tokens_per_s'] for r in rs])} | {statistics.median(cpu) if cpu else float('nan'):.2f} "
          f"| {tokens:,} | {per_k} |")
  mt = [v for label, v in med.items() if label.startswith("MaxText")]
  if mt:
    best = max(mt)
    print(f"\nours default / MaxText's best ({[l for l, v in med.items() if v == best][0]}): "
          f"**{med['ours default (one device per core)'] / best:.2f}x**")
  return 0


def _cpu_text(s: dict) -> str:
  return f"{s['cpu_s']:.2f} CPU-s/step" if s.get("cpu_s") else "n/a"


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--maxtext-python", default="", help="python of a venv with maxtext installed "
                  "(../shared/notes/maxtext-on-cpu.md); without it only our runs")
  ap.add_argument("--devices", default="1,2,4")
  ap.add_argument("--meshes", default="fsdp,data")
  ap.add_argument("--dtypes", default="float32,bfloat16")
  ap.add_argument("--steps", type=int, default=21)
  ap.add_argument("--first-step", type=int, default=5, help="median over steps >= this")
  ap.add_argument("--repeats", type=int, default=3,
                  help="repetitions of every run, the order of the cells and of the trainers "
                       "reversed on every other one; the table gives medians and [min–max]")
  ap.add_argument("--as-mt", action="store_true", help="also ours with remat_policy=full")
  ap.add_argument("--out", default="", help="work directory (default: a temporary one)")
  ap.add_argument("--default-run", action="store_true", help="the README run vs MaxText's best")
  args = ap.parse_args()
  out = os.path.abspath(args.out) if args.out else tempfile.mkdtemp(prefix="tiny_train_")
  os.makedirs(out, exist_ok=True)
  if args.default_run:
    return default_run(args, out)
  matrix = cells([int(x) for x in args.devices.split(",")], args.meshes.split(","),
                 args.dtypes.split(","))
  kinds = ["ours"] + (["ours-as-mt"] if args.as_mt else []) + (["maxtext"] if args.maxtext_python else [])
  print(f"{len(matrix)} cells x {len(kinds)} trainers x {args.repeats} repeats; {load()}", flush=True)
  results: dict[tuple, list[dict]] = {}
  for rep in range(args.repeats):
    for cell in run_order(matrix, rep):
      env = dict(os.environ, JAX_PLATFORMS="cpu", DECOUPLE_GCLOUD="TRUE",
                 XLA_FLAGS=f"--xla_force_host_platform_device_count={cell['devices']}")
      tag = f"{cell['devices']}{cell['mesh']}-{cell['dtype']}-{rep}"
      for kind in run_order(kinds, rep):
        name = f"{kind}-{tag}"
        if kind == "maxtext":
          cmd = maxtext_cmd(args.maxtext_python, out, name, cell, args.steps)
        else:
          extra = ["remat_policy=full", "scan_layers=true"] if kind == "ours-as-mt" else []
          cmd = ours_cmd(out, name, cell, args.steps, extra)
        log_path = os.path.join(out, f"{name}.log")
        code, rss, wall, cpu_rows = run(cmd, env, log_path, os.path.join(out, name, "metrics.jsonl"))
        if code != 0:
          print(f"{name}: exit {code}; see {log_path}", file=sys.stderr)
          return 1
        s = summarise(kind, os.path.join(out, name), args.first_step, cell["devices"])
        s.update(rss_gib=rss, wall_s=wall, cpu_s=cpu_per_step(cpu_rows, args.first_step))
        results.setdefault((kind, cell["devices"], cell["mesh"], cell["dtype"]), []).append(s)
        print(f"  {name:32s} {s['tokens_per_s']:8,.0f} tok/s  {_cpu_text(s)}  ({load()})",
              flush=True)

  print(f"\n{load()}\n")
  print("\n".join(matrix_table(matrix, kinds, results)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
