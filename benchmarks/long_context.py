"""Training cost against the sequence length: one training step (the trainer's own compiled step:
forward, backward, AdamW) of qwen3-next-tiny (3 Gated DeltaNet layers + 1 gated-attention layer)
against a Qwen3 dense model of the same width and depth (4 attention layers: D 64, 4/2 heads of
16, q/k norm, SwiGLU 128) and qwen3-next-tiny with that dense SwiGLU instead of its experts (only
the token mixers differ from the dense model; on XLA:CPU the experts' `ragged_dot` is a slow
loop) — and, with `--models next-linear`, all four layers Gated DeltaNet (no attention layer) —
then the chunked gated delta rule against the token-by-token scan
(`linear_recurrence=token`) at one length in `--scan-model` (e.g. `next-linear-wide`: all linear,
the published model's DeltaNet head widths of 128, where the rule is most of the step).

  .venv/bin/python benchmarks/long_context.py [--seqs 1024,2048,4096,8192,16384] [--batch 1]
      [--models next,next-dense,dense] [--rounds 3] [--scan-seq 4096] [--scan-model next]
      [--cp 1,2,4] [--cp-seq 2048] [--cp-models dense,next-dense] [--mem-fraction 0.5] [--out FILE]

`--cp 1,2,4`: context parallelism rows at `--cp-seq` (attention=flash, the Pallas kernel; on CPU
in the interpreter) on as many fake CPU devices (`--xla_force_host_platform_device_count=8` is
set when XLA_FLAGS has no device count): CP 1 on one device, then CP n on n devices with the same
global batch for each strategy (all_gather, ring); the compiled step's memory is per device.

One sequence length at a time (so that only its programs are held): every configuration is
compiled once (cold: no persistent cache), then `--rounds` rounds each run every configuration's
step once, alternating, so that load on a shared machine hits all alike (each row is printed when
its length is done). Compute float32 (the configs' dtype=auto as `load_config` gives it: the
tools' dtype, not train.py's bfloat16), weights float32, the loss over the whole sequence (the
vocabulary is 6x the width: no auto chunks); the output says so. The table gives the median
step time, tokens/s = batch x S / step, and the compiled step's memory (`memory_analysis()`:
"temp" is XLA's scratch, where the S x S attention scores live; "peak" = arguments + outputs +
temp - donated aliases). A step whose compiled peak
exceeds `--mem-fraction` (0.5) of the free host memory is not run (the machine may be shared).
All models use attention=dot_product (XLA; the Pallas kernels run only in the interpreter on CPU)
and remat_policy=save_matmuls (the default): one attention layer's S x S scores then set the peak
of both qwen3-next-tiny (its one full layer) and the dense model, which is why `next-linear`
exists. `uptime` is printed before and after. On a GPU the same command runs the same programs
there (e.g. --seqs 8192,...,65536; attention=flash or cudnn there keeps the full layers' memory
linear too).
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
if "--cp" in sys.argv and "device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

COMMON = ["vocab_size=384", "emb_dim=64", "num_decoder_layers=4", "num_query_heads=4",
          "num_kv_heads=2", "head_dim=16", "mlp_dim=128", "ici_fsdp_parallelism=1",
          "attention=dot_product", "dataset_type=synthetic", "enable_tensorboard=false",
          "enable_checkpointing=false", "jax_cache_dir=", "max_position_embeddings=65536"]
DENSE_MLP = ["num_experts=0", "moe_mlp_dim=0", "shared_expert_mlp_dim=0"]
MODELS = {   # id: (label, overrides)
    "next": ("qwen3-next-tiny", ["model_name=qwen3-next-tiny"]),
    # the same mixers with the dense model's MLP: only the token mixing differs from "qwen3 dense"
    "next-dense": ("qwen3-next-tiny, dense MLP", ["model_name=qwen3-next-tiny", *DENSE_MLP]),
    # 4 Gated DeltaNet layers, no attention layer at all: the linear mixer alone
    "next-linear": ("qwen3-next-tiny, dense MLP, all 4 layers linear",
                    ["model_name=qwen3-next-tiny", "attention_pattern=l", *DENSE_MLP]),
    # the same with the published model's DeltaNet head widths (key / value heads of 128)
    "next-linear-wide": ("qwen3-next-tiny, dense MLP, all 4 layers linear, heads of 128",
                         ["model_name=qwen3-next-tiny", "attention_pattern=l", *DENSE_MLP,
                          "linear_key_head_dim=128", "linear_value_head_dim=128"]),
    "dense": ("qwen3 dense", ["model_name=qwen3-tiny"]),
}


def uptime() -> str:
  try:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
  except OSError:
    return "uptime unavailable"


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--seqs", default="1024,2048,4096,8192,16384")
  ap.add_argument("--models", default="next,next-dense,dense",
                  help=f"comma-separated, of {', '.join(MODELS)}")
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--scan-seq", type=int, default=4096)
  ap.add_argument("--scan-model", default="next", help=f"the model of the chunked vs token "
                  f"comparison, one of {', '.join(MODELS)}")
  ap.add_argument("--cp", default="", help="context parallelism sizes, e.g. 1,2,4")
  ap.add_argument("--cp-seq", type=int, default=2048)
  ap.add_argument("--cp-models", default="dense,next-dense")
  ap.add_argument("--out", default="")
  ap.add_argument("--mem-fraction", type=float, default=0.5,
                  help="skip a step whose compiled peak exceeds this part of the free memory")
  args = ap.parse_args()

  import jax
  import numpy as np
  import psutil

  from MaxText.config.load import load_config
  from MaxText.train.loop import Trainer
  from MaxText.train.state import init_state
  from MaxText.data.batch import BATCH_KEYS

  devices = jax.devices()[:1]
  base = os.path.join(ROOT, "configs", "base.yml")

  def build(name, overrides, S, n=1):
    given = {o.split("=", 1)[0] for o in overrides}
    common = [c for c in COMMON if c.split("=", 1)[0] not in given]   # e.g. attention=flash
    cfg = load_config([base, *overrides, *common, f"max_target_length={S}",
                       f"per_device_batch_size={args.batch / n:g}"])
    t = Trainer(cfg, jax.devices()[:n])
    t0 = time.perf_counter()
    compiled = t.compile_step()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    peak = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
            - mem.alias_size_in_bytes)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (args.batch, S)).astype(np.int32)
    host = {"inputs": tokens, "targets": np.roll(tokens, -1, 1),
            "inputs_position": np.tile(np.arange(S, dtype=np.int32), (args.batch, 1)),
            "inputs_segmentation": np.ones((args.batch, S), np.int32),
            "targets_segmentation": np.ones((args.batch, S), np.int32)}
    batch = {k: jax.device_put(host[k], t.batch_sharding) for k in BATCH_KEYS}
    print(f"compiled {name} at S={S} in {compile_s:.1f} s: peak {peak / 2**20:,.0f} MiB",
          file=sys.stderr, flush=True)
    setting = (f"compute {t.cfg.dtype}, weights {t.cfg.weight_dtype}, loss "
               + (f"in chunks of {t.cfg.loss_chunk_length}" if t.cfg.loss_chunk_length
                  else "over the whole sequence"))
    return {"name": name, "S": S, "trainer": t, "compiled": compiled, "batch": batch,
            "setting": setting,
            "temp": mem.temp_size_in_bytes, "peak": peak, "compile_s": compile_s, "times": [],
            "state": None}

  def step(run):
    if run["state"] is None:
      t = run["trainer"]
      run["state"] = init_state(t.mcfg, 0, t.tx, t.shardings)
    t0 = time.perf_counter()
    run["state"], metrics = run["compiled"](run["state"], run["batch"])
    jax.block_until_ready(metrics["loss"])
    run["times"].append(time.perf_counter() - t0)

  def row(run):
    if run["skip"]:
      return (f"| {run['name']} | {run['S']} | skipped: compiled peak {run['peak'] / 2**30:.1f} "
              f"GiB > {args.mem_fraction:.0%} of the free {run['free'] / 2**30:.1f} GiB | | | "
              f"{run['temp'] / 2**20:,.0f} | "
              f"{run['peak'] / 2**20:,.0f} | {run['compile_s']:.1f} |")
    t = statistics.median(run["times"])
    tps = args.batch * run["S"] / t
    return (f"| {run['name']} | {run['S']} | {t * 1e3:,.0f} | {tps:,.0f} | "
            f"{run['temp'] / 2**20:,.0f} | {run['peak'] / 2**20:,.0f} | {run['compile_s']:.1f} |")

  seqs = [int(s) for s in args.seqs.split(",") if s]
  models = [MODELS[m] for m in args.models.split(",") if m]
  groups = [[(name, over, S) for name, over in models] for S in seqs]
  if args.scan_seq:
    label, overrides = MODELS[args.scan_model]
    groups.append([(f"{label}, {kind}", [*overrides,
                                                 f"linear_recurrence={kind}"], args.scan_seq)
                   for kind in ("chunked", "token")])
  cp_sizes = [int(n) for n in args.cp.split(",") if n]
  for m in (m for m in args.cp_models.split(",") if m and cp_sizes):
    label, overrides = MODELS[m]
    groups.append([(f"{label}, flash, CP {n}" + (f" {strategy}" if n > 1 else ""),
                    [*overrides, "attention=flash", f"ici_context_parallelism={n}",
                     f"context_parallel_strategy={strategy}"], args.cp_seq, n)
                   for n in cp_sizes for strategy in (("all_gather",) if n == 1 else
                                                      ("all_gather", "ring"))])
  load_before = uptime()
  done_groups = []
  for group in groups:   # one length at a time: its models compiled, then run alternately
    runs = [build(*g) for g in group]
    free = psutil.virtual_memory().available
    for run in runs:
      run["free"] = free
      run["skip"] = run["peak"] > args.mem_fraction * free
      if not run["skip"]:
        step(run)                                  # first call: allocation, not timed below
        run["times"].clear()
    for _ in range(args.rounds):
      for run in runs:
        if not run["skip"]:
          step(run)
    for run in runs:   # keep the figures, free the compiled step, its state and its batch
      for key in ("trainer", "compiled", "batch", "state"):
        run.pop(key)
      print(row(run), flush=True)
    done_groups.append(runs)
    gc.collect()
  load_after = uptime()

  head = ("| model | S | step ms | tokens/s | temp MiB | peak MiB | compile s |\n"
          "|---|---|---|---|---|---|---|")
  lines = [f"{devices[0].platform} ({devices[0].device_kind}), jax {jax.__version__}; batch "
           f"{args.batch}, {'; '.join(sorted({r['setting'] for g in done_groups for r in g}))}"
           f"; one training step (fwd + bwd + AdamW), median of {args.rounds} alternating rounds",
           f"load before: {load_before}", f"load after:  {load_after}"]
  if seqs:
    lines += ["", head, *(row(r) for runs in done_groups[:len(seqs)] for r in runs)]
  if cp_sizes:
    lines += ["", f"Context parallelism at S = {args.cp_seq}, attention=flash (the memory columns "
              f"per device; the same global batch on n devices)", "", head,
              *(row(r) for runs in done_groups for r in runs if ", CP " in r["name"])]
  if args.scan_seq:
    scan = done_groups[len(seqs)]
    lines += ["", f"Gated delta rule at S = {args.scan_seq}: chunked (chunk 64) vs token by token "
              f"({MODELS[args.scan_model][0]})",
              "", head, *map(row, scan)]
    done = [r for r in scan if not r["skip"]]
    if len(done) == 2:
      ratio = statistics.median(done[1]["times"]) / statistics.median(done[0]["times"])
      lines.append(f"\ntoken-by-token step / chunked step = {ratio:.1f}x")
  text = "\n".join(lines)
  print(text)
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      f.write(text + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
