"""The train step's compile time, ours against MaxText's, per family, cold and warm, in one table.

    .venv/bin/python benchmarks/compile_time.py --maxtext-python /work/mt/venv/bin/python
    .venv/bin/python benchmarks/compile_time.py --families qwen3-next --repeats 3   # one row

Every family both trainers have, on the same tiny model (the table below: width 64, 4 query / 2 kv
heads, vocabulary 384, 128 tokens x 4 sequences, one CPU device, bf16 compute and fp32 weights),
each trainer with its own defaults otherwise (remat, scan). Each run goes through
benchmarks/compile_probe.py, which records jax's own compile events (tracing, lowering to MLIR,
XLA compilation or persistent-cache load) by program name for either trainer alike; the train
step's compile time is the sum of the three for its program (ours `step`, MaxText's `train_step`).
Cold: a fresh, empty persistent compilation cache; warm: the same run again on the cache the cold
run filled (a new process: tracing and lowering are paid again, the XLA compile is a cache load).

The verdict (ours ≤ 0.5× MaxText's cold compile) is taken on XLA's CPU seconds, which the load of
a shared machine barely changes; the wall seconds are printed too, with the load average.

`--kernels` also counts the LLVM modules XLA:CPU compiles for the train step (its kernels: one per
distinct fusion; the cold compile's cost follows their number) from XLA's own log lines
(`TF_CPP_VMODULE=ir_compiler=1`) written while the step's compile ran, for either trainer alike.

Each repetition runs the families in turn and, per family, both trainers cold then warm, the
trainers' order reversed on every other repetition (the machine is shared: its load average is
printed with every run); the table gives the medians over the repetitions and their [min–max].
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = os.path.join(ROOT, "benchmarks", "compile_probe.py")

# the shared shape of every family's model, in each trainer's keys
OURS_COMMON = ["vocab_size=384", "emb_dim=64", "num_query_heads=4", "num_kv_heads=2",
               "max_target_length=128", "per_device_batch_size=4", "dtype=bfloat16",
               "weight_dtype=float32"]
MT_COMMON = ["vocab_size=384", "base_emb_dim=64", "base_num_query_heads=4", "base_num_kv_heads=2",
             "max_target_length=128", "per_device_batch_size=4", "dtype=bfloat16",
             "weight_dtype=float32", "normalization_layer_epsilon=1e-6"]

# family -> (our keys, MaxText's keys): the same model in each trainer's terms
FAMILIES: dict[str, tuple[list[str], list[str]]] = {
    "llama": (["num_decoder_layers=4", "head_dim=32", "mlp_dim=128"],
              ["decoder_block=llama2", "base_num_decoder_layers=4", "head_dim=32",
               "base_mlp_dim=128", 'mlp_activations=["silu","linear"]']),
    "qwen3": (["model_name=qwen3-tiny", "num_decoder_layers=4"],
              ["decoder_block=qwen3", "base_num_decoder_layers=4", "head_dim=32",
               "base_mlp_dim=128", 'mlp_activations=["silu","linear"]', "use_qk_norm=true",
               "rope_max_timescale=1000000"]),
    "qwen3-moe": (["model_name=qwen3-moe-tiny", "num_decoder_layers=4"],
                  ["decoder_block=qwen3_moe", "base_num_decoder_layers=4", "head_dim=32",
                   "base_mlp_dim=128", 'mlp_activations=["silu","linear"]', "use_qk_norm=true",
                   "num_experts=8", "num_experts_per_tok=2", "base_moe_mlp_dim=32",
                   "norm_topk_prob=true", "rope_max_timescale=1000000"]),
    # 12 layers: two runs of MaxText's fixed pattern (5 sliding, 1 full), the last 6 KV-shared
    "gemma4": (["model_name=gemma4-tiny", "num_decoder_layers=12", "attention_pattern=sssssf",
                "num_kv_shared_layers=6", "attention_k_eq_v=false", "global_num_kv_heads=0"],
               ["decoder_block=gemma4_small", "scan_layers=false",   # it refuses a scan
                "base_num_decoder_layers=12", "head_dim=16",
                "global_head_dim=32", "base_mlp_dim=128", 'mlp_activations=["gelu","linear"]',
                "logits_via_embedding=true", "use_post_attn_norm=true", "use_post_ffw_norm=true",
                "sliding_window_size=16", "v_norm_with_scale=false",
                "hidden_size_per_layer_input=8", "vocab_size_per_layer_input=384",
                "num_kv_shared_layers=6", "use_double_wide_mlp=true",
                "local_rope_max_timescale=10000", "global_rope_max_timescale=1000000",
                "rope_max_timescale=1000000", "global_rope_proportion=0.25",
                "local_rope_proportion=1.0", "final_logits_soft_cap=30.0"]),
    # 3 Gated DeltaNet layers + 1 gated attention layer, 8 experts top-2 and a shared expert
    "qwen3-next": (["model_name=qwen3-next-tiny", "linear_chunk_size=64"],
                   ["decoder_block=qwen3_next", "base_num_decoder_layers=4", "head_dim=16",
                    "base_mlp_dim=32", "base_moe_mlp_dim=32", "num_experts=8", "shared_experts=1",
                    "num_experts_per_tok=2", "norm_topk_prob=true",
                    "inhomogeneous_layer_cycle_interval=4", "gdn_conv_kernel_dim=4",
                    "gdn_key_head_dim=16", "gdn_value_head_dim=16", "gdn_num_key_heads=2",
                    "gdn_num_value_heads=4", "gdn_chunk_size=64", "partial_rotary_factor=0.25",
                    "rope_max_timescale=1000000"]),
}
STEP = {"ours": "step", "maxtext": "train_step"}


def program(name: str) -> str:
  """A program's name as the events give it ('jit(step)', 'jit_step', 'step') -> 'step'."""
  for prefix in ("jit(", "jit_", "pjit(", "pjit_"):
    if name.startswith(prefix):
      name = name[len(prefix):]
  return name.rstrip(")")


def step_seconds(events_path: str, trainer: str) -> dict[str, float]:
  """The train step's trace, lower, compile (or cache load) wall seconds from a probe's events, and
  `compile_cpu`: the process's CPU seconds from the end of the step's lowering to the end of its
  compile (XLA's work on it, all threads)."""
  out = {"trace": 0.0, "lower": 0.0, "compile": 0.0, "cache_load": 0.0, "compile_cpu": 0.0}
  lowered_cpu = None
  with open(events_path, encoding="utf-8") as f:
    for line in f:
      e = json.loads(line)
      if program(e["name"]) == STEP[trainer] or (e["event"] == "cache_load" and not e["name"]):
        out[e["event"]] += e["s"]
        if e["event"] == "lower":
          lowered_cpu = e["cpu"]
        elif e["event"] == "compile" and lowered_cpu is not None:
          out["compile_cpu"] += e["cpu"] - lowered_cpu
  if not out["compile"]:
    raise RuntimeError(f"no compile event of {STEP[trainer]!r} in {events_path}")
  out["total"] = out["trace"] + out["lower"] + out["compile"]
  return out


# XLA's log line for each LLVM module it compiles (glog's prefix: local month, day and time)
KERNEL_LINE = re.compile(r"^I(\d\d)(\d\d) (\d\d):(\d\d):(\d\d\.\d+)\s+\d+ ir_compiler\.cc:\d+\] "
                         r"Compiled LLVM module")


def step_kernels(events_path: str, log_path: str, trainer: str) -> int:
  """The LLVM modules (kernels) XLA:CPU compiled while the train step's compile ran: the log's
  `KERNEL_LINE`s stamped between the start and the end of the step's compile event (a run with
  `--kernels`; the trainers compile one program at a time)."""
  window = None
  with open(events_path, encoding="utf-8") as f:
    for line in f:
      e = json.loads(line)
      if e["event"] == "compile" and program(e["name"]) == STEP[trainer]:
        window = (e["t"] - e["s"], e["t"])
  if window is None:
    raise RuntimeError(f"no compile event of {STEP[trainer]!r} in {events_path}")
  year = datetime.datetime.fromtimestamp(window[1]).year
  count = 0
  with open(log_path, encoding="utf-8", errors="replace") as f:
    for line in f:
      m = KERNEL_LINE.match(line)
      if m:
        month, day, hour, minute, sec = m.groups()
        t = datetime.datetime(year, int(month), int(day), int(hour), int(minute)).timestamp()
        if window[0] <= t + float(sec) <= window[1]:
          count += 1
  return count


def command(trainer: str, family: str, out: str, name: str, mt_python: str) -> list[str]:
  ours, theirs = FAMILIES[family]
  if trainer == "ours":
    return [sys.executable, PROBE, f"{out}/{name}.events", "--cache-dir", f"{out}/cache-{name[:-5]}",
            os.path.join(ROOT, "train.py"), os.path.join(ROOT, "configs/base.yml"), *OURS_COMMON,
            *ours, "steps=2", "enable_checkpointing=false", "enable_tensorboard=false",
            "jax_cache_dir=", "dataset_type=synthetic", f"base_output_directory={out}",
            f"run_name={name}"]
  site = subprocess.run([mt_python, "-c", "import maxtext, os; print(os.path.dirname(maxtext.__file__))"],
                        capture_output=True, text=True, check=True).stdout.strip()
  return [mt_python, PROBE, f"{out}/{name}.events", "--cache-dir", f"{out}/cache-{name[:-5]}",
          "-m", "maxtext.trainers.pre_train.train", os.path.join(site, "configs/base.yml"),
          "run_name=mt", f"base_output_directory={out}/{name}", "hardware=cpu",
          "skip_jax_distributed_system=true", "dataset_type=synthetic", "packing=false", "steps=2",
          "enable_checkpointing=false", "attention=dot_product", "jax_cache_dir=",
          "enable_tensorboard=false", "model_name=default", *MT_COMMON, *theirs]


def load() -> str:
  return "load " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def spread(values: list[float]) -> str:
  if not values:
    return "n/a"
  if len(values) == 1:
    return f"{values[0]:.1f}"
  return f"{statistics.median(values):.1f} [{min(values):.1f}–{max(values):.1f}]"


def table(results: dict[tuple[str, str, str], list[dict]], families: list[str],
          trainers: list[str], failed: set[tuple[str, str]], loads: list[float]) -> None:
  """Prints the table (medians over the repetitions, [min–max]) and the cold phases."""
  med = lambda family, trainer, phase: statistics.median(
      r["total"] for r in results[(family, trainer, phase)])
  if loads:
    print(f"\nload average over the runs: median {statistics.median(loads):.1f}, "
          f"max {max(loads):.1f} ({os.cpu_count()} cores)\n")
  cols = [f"{t} {p} s" for t in trainers for p in ("cold", "warm")]
  head = "| family | " + " | ".join(cols)
  counted = any("kernels" in r for f in families for t in trainers
                for r in results.get((f, t, "cold"), []))
  if "maxtext" in trainers:
    head += " | ours / MaxText cold (wall) | XLA CPU-s cold ours / MaxText | ≤ 0.5× (CPU-s)"
  if counted:
    head += " | kernels " + " / ".join(trainers)
  print(head + " |\n|" + "---|" * (head.count("|")))
  for family in families:
    if any((family, t) in failed for t in trainers):
      print(f"| {family} | " + " | ".join(
          "failed" if (family, t) in failed else spread([r["total"] for r in results[(family, t, p)]])
          for t in trainers for p in ("cold", "warm")) + " |")
      continue
    line = f"| {family} | " + " | ".join(
        spread([r["total"] for r in results.get((family, t, p), [])]) for t in trainers
        for p in ("cold", "warm"))
    if "maxtext" in trainers:
      ratio = med(family, "ours", "cold") / med(family, "maxtext", "cold")
      cpu = [statistics.median(r["compile_cpu"] for r in results[(family, t, "cold")])
             for t in ("ours", "maxtext")]
      each = [spread([r["compile_cpu"] for r in results[(family, t, "cold")]])
              for t in ("ours", "maxtext")]
      line += (f" | {ratio:.2f}× | {each[0]} / {each[1]} (**{cpu[0] / cpu[1]:.2f}×**) | "
               f"{'yes' if cpu[0] / cpu[1] <= 0.5 else 'no'}")
    if counted:
      line += " | " + " / ".join(spread([r["kernels"] for r in results[(family, t, "cold")]
                                          if "kernels" in r]).replace(".0", "")
                                 for t in trainers)
    print(line + " |")
  print("\nthe step, cold, median seconds by phase (trace / lower / XLA compile; XLA's CPU-s):")
  for family in families:
    if any((family, t) in failed for t in trainers):
      continue
    rs = results[(family, "ours", "cold")]
    parts = " / ".join(f"{statistics.median(r[k] for r in rs):.1f}"
                       for k in ("trace", "lower", "compile", "compile_cpu"))
    line = f"  {family:11s} ours {parts}"
    if "maxtext" in trainers:
      rs = results[(family, "maxtext", "cold")]
      line += "   MaxText " + " / ".join(f"{statistics.median(r[k] for r in rs):.1f}"
                                         for k in ("trace", "lower", "compile", "compile_cpu"))
    print(line)


def from_folders(outs: list[str]) -> int:
  """The table of earlier runs' folders (--table-from A,B: runs of the same families at the same
  time, each a repetition of its own): every repetition that finished."""
  results: dict[tuple[str, str, str], list[dict]] = {}
  for out, name in sorted((folder, f) for folder in outs for f in os.listdir(folder)):
    m = re.fullmatch(r"(ours|maxtext)-(.+)-(\d+)-(cold|warm)\.events", name)
    if m:
      trainer, family, _, phase = m.groups()
      try:
        seconds = step_seconds(os.path.join(out, name), trainer)
        log = os.path.join(out, name[:-len(".events")] + ".log")
        if phase == "cold" and os.path.exists(log):
          kernels = step_kernels(os.path.join(out, name), log, trainer)
          if kernels:   # a run with --kernels
            seconds["kernels"] = kernels
      except RuntimeError:
        continue   # a run that did not get as far as its step's compile
      results.setdefault((family, trainer, phase), []).append(seconds)
  families = [f for f in FAMILIES if all((f, t, "cold") in results for t in ("ours", "maxtext"))]
  table(results, families, ["ours", "maxtext"], set(), [])
  return 0


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--maxtext-python", default="", help="python of a venv with maxtext installed "
                  "(../shared/notes/maxtext-on-cpu.md); without it only our runs")
  ap.add_argument("--families", default=",".join(FAMILIES))
  ap.add_argument("--repeats", type=int, default=2)
  ap.add_argument("--kernels", action="store_true", help="count the step's kernels too (XLA's "
                  "ir_compiler log lines)")
  ap.add_argument("--out", default="", help="work directory (default: a temporary one)")
  ap.add_argument("--table-from", default="", help="only the table of earlier runs' --out "
                  "folders, comma-separated (the repetitions that finished)")
  args = ap.parse_args()
  if args.table_from:
    return from_folders(args.table_from.split(","))
  out = os.path.abspath(args.out) if args.out else tempfile.mkdtemp(prefix="compile_time_")
  os.makedirs(out, exist_ok=True)
  families = args.families.split(",")
  trainers = ["ours"] + (["maxtext"] if args.maxtext_python else [])
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
  env.update(JAX_PLATFORMS="cpu", DECOUPLE_GCLOUD="TRUE", PYTHONPATH=ROOT,
             XLA_FLAGS="--xla_force_host_platform_device_count=1")
  if args.kernels:
    env.update(TF_CPP_VMODULE="ir_compiler=1", TF_CPP_MIN_LOG_LEVEL="0")
  results: dict[tuple[str, str, str], list[dict]] = {}
  loads: list[float] = []
  failed: set[tuple[str, str]] = set()
  print(f"{len(families)} families x {len(trainers)} trainers x cold/warm x {args.repeats}; {load()}",
        flush=True)
  for rep in range(args.repeats):
    for family in families:
      for trainer in (trainers if rep % 2 == 0 else trainers[::-1]):
        shutil.rmtree(f"{out}/cache-{trainer}-{family}-{rep}", ignore_errors=True)
        for phase in ("cold", "warm"):
          name = f"{trainer}-{family}-{rep}-{phase}"
          if os.path.exists(f"{out}/{name}.events"):
            os.remove(f"{out}/{name}.events")
          cmd = command(trainer, family, out, name, args.maxtext_python)
          with open(f"{out}/{name}.log", "w") as log:
            code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=out,
                                  check=False).returncode
          if code != 0:   # e.g. a family the peer's version cannot run: the row says so
            print(f"  {name}: exit {code}; see {out}/{name}.log", flush=True)
            failed.add((family, trainer))
            break
          s = step_seconds(f"{out}/{name}.events", trainer)
          if args.kernels and phase == "cold":
            s["kernels"] = step_kernels(f"{out}/{name}.events", f"{out}/{name}.log", trainer)
          results.setdefault((family, trainer, phase), []).append(s)
          loads.append(os.getloadavg()[0])
          print(f"  {name:28s} step: trace {s['trace']:5.1f} lower {s['lower']:5.1f} "
                f"compile {s['compile']:5.1f} = {s['total']:5.1f} s; XLA CPU {s['compile_cpu']:5.1f} s"
                + (f"; {s['kernels']} kernels" if "kernels" in s else "") + f"  ({load()})", flush=True)

  table(results, families, trainers, failed, loads)
  return 0


if __name__ == "__main__":
  sys.exit(main())
