"""The training step on an accelerator, variant by variant in ONE process (the chip is opened once):
per variant (key=value overrides of one model), the memory pre-flight's estimate, XLA's count of the
compiled step's buffers (`memory_analysis`), the fresh init's time (its program compiled and run),
the compile time, the steps' time, tokens/s, TFLOP/s and MFU (MaxText's accounting, the one
`train.py` prints), and the loss. A variant that does not fit is reported, not fatal. Variants run
one after another, each freed before the next (the chip holds one at a time).

  python3 benchmarks/tpu_step.py --out rows.json --steps 10 \\
      --base "model_name=qwen3-0.6b max_target_length=2048 per_device_batch_size=8" \\
      --variant "full: remat_policy=full" --variant "matmuls b4: remat_policy=save_matmuls \\
      per_device_batch_size=4"

Prints one Markdown table (and writes the rows as JSON to --out).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

GiB = 2**30

from ab_step import synthetic_batch  # noqa: E402  (one global batch of random tokens)


def run_variant(label: str, argv: list[str], steps: int) -> dict:
  import jax  # pylint: disable=import-outside-toplevel

  from MaxText.config.load import load_config  # pylint: disable=import-outside-toplevel
  from MaxText.metrics.peaks import device_peak_tflops  # pylint: disable=import-outside-toplevel
  from MaxText.models.registry import training_flops  # pylint: disable=import-outside-toplevel
  from MaxText.train import memory  # pylint: disable=import-outside-toplevel
  from MaxText.train.loop import Trainer  # pylint: disable=import-outside-toplevel
  from MaxText.train.state import init_state  # pylint: disable=import-outside-toplevel

  row: dict = {"label": label, "keys": " ".join(argv)}
  work = tempfile.mkdtemp(prefix="tpu_step_")
  cfg = load_config([os.path.join(ROOT, "configs/base.yml"), "jax_cache_dir=",
                     f"base_output_directory={work}", "run_name=tpu_step", *argv], keep_auto=True)
  trainer = Trainer(cfg, jax.devices())
  cfg = trainer.cfg
  est = trainer.memory_estimate()
  row.update(estimate_gib=est.needed / GiB, available_gib=est.available / GiB,
             estimate_state_gib=est.state / GiB, estimate_activations_gib=est.activations / GiB,
             preflight="refuses" if est.needed > est.available else "passes",
             remat=cfg.remat_policy, batch=trainer.global_batch, seq=cfg.max_target_length,
             dtype=cfg.dtype, weight_dtype=cfg.weight_dtype,
             loss_chunk_length=cfg.loss_chunk_length)
  t0 = time.perf_counter()
  try:
    compiled = trainer.compile_step()
  except Exception as e:  # noqa: BLE001 — an out-of-memory compile is a result
    row.update(status="compile failed", error=str(e).splitlines()[0][:300])
    return row
  row["compile_s"] = time.perf_counter() - t0
  compiled_bytes = memory.compiled_step_bytes(compiled)
  if compiled_bytes is not None:
    row["compiled_gib"] = compiled_bytes / GiB
    row["compiled_plus_runtime_gib"] = (compiled_bytes + est.runtime) / GiB
  t0 = time.perf_counter()
  try:
    state = init_state(trainer.mcfg, 0, trainer.tx, trainer.shardings)
    jax.block_until_ready(state)
    row["init_s"] = time.perf_counter() - t0
    batch = synthetic_batch(trainer)
    losses = []
    for _ in range(2):   # warm-up
      state, metrics = compiled(state, batch)
      losses.append(float(metrics["loss"]))
    times = []
    for _ in range(steps):
      t0 = time.perf_counter()
      state, metrics = compiled(state, batch)
      jax.block_until_ready(metrics)
      times.append(time.perf_counter() - t0)
    losses.append(float(metrics["loss"]))
  except Exception as e:  # noqa: BLE001 — out of memory at run time is a result too
    row.update(status="run failed", error=str(e).splitlines()[0][:300])
    return row
  step_s = statistics.median(times)
  flops = training_flops(trainer.mcfg, seq_len=cfg.max_target_length,
                         global_batch=trainer.global_batch)["total"]
  peak = device_peak_tflops(jax.devices()[0], cfg.peak_tflops_per_device, cfg.dtype).tflops
  n = len(jax.devices())
  row.update(status="ok", step_s=step_s, steps=steps,
             tokens_per_s=trainer.global_batch * cfg.max_target_length / step_s,
             tflops_per_s_per_device=flops / step_s / n / 1e12,
             mfu=flops / step_s / n / 1e12 / peak, peak_tflops=peak, tflop_per_step=flops / 1e12,
             loss_first=losses[0], loss_last=losses[-1])
  try:
    stats = jax.devices()[0].memory_stats() or {}
    row["peak_bytes_in_use_gib"] = stats.get("peak_bytes_in_use", 0) / GiB
  except Exception:  # noqa: BLE001
    pass
  del state, batch, compiled
  return row


def table(rows: list[dict]) -> str:
  head = ("| variant | remat | batch | pre-flight est. GiB | XLA compiled GiB (+1 runtime) | est. "
          "error | compile s | init s | s/step | tokens/s | TFLOP/s/dev | MFU | loss |")
  out = [head, "|" + "---|" * 13]
  for r in rows:
    if r.get("status") != "ok" and "compiled_gib" not in r:
      out.append(f"| {r['label']} | {r.get('remat', '')} | {r.get('batch', '')} | "
                 f"{r.get('estimate_gib', 0):.2f} ({r.get('preflight', '')}) | {r.get('status')}: "
                 f"{r.get('error', '')[:120]} | | | | | | | | |")
      continue
    comp = r.get("compiled_plus_runtime_gib")
    err = f"{(r['estimate_gib'] - comp) / comp:+.1%}" if comp else ""
    if r.get("status") != "ok":
      out.append(f"| {r['label']} | {r['remat']} | {r['batch']} | {r['estimate_gib']:.2f} | "
                 f"{r.get('compiled_gib', 0):.2f} | {err} | {r.get('compile_s', 0):.1f} | "
                 f"{r.get('status')}: {r.get('error', '')[:120]} | | | | | |")
      continue
    out.append(
        f"| {r['label']} | {r['remat']} | {r['batch']} | {r['estimate_gib']:.2f} "
        f"({r['preflight']}) | {r.get('compiled_gib', 0):.2f} | {err} | {r['compile_s']:.1f} | "
        f"{r['init_s']:.1f} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | "
        f"{r['tflops_per_s_per_device']:.1f} | {r['mfu']:.1%} | "
        f"{r['loss_first']:.3f} → {r['loss_last']:.3f} |")
  return "\n".join(out)


def variant_parser(description: str) -> argparse.ArgumentParser:
  """--base and --variant (repeated), as tpu_step.py and tpu_aot.py take them."""
  ap = argparse.ArgumentParser(description=description,
                               formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--base", default="", help="key=value overrides every variant starts from")
  ap.add_argument("--variant", action="append", required=True,
                  help='"label: key=value ..." (repeat); its keys replace the base\'s')
  ap.add_argument("--out", default="", help="write the rows as JSON here")
  return ap


def variants(base: str, texts: list[str]) -> list[tuple[str, list[str]]]:
  """(label, argv) per "label: key=value ..." text: the base's keys, those the variant sets
  replaced by its own."""
  out = []
  for text in texts:
    label, _, keys = text.partition(":")
    given = shlex.split(keys)
    names = {k.split("=", 1)[0] for k in given}
    out.append((label.strip(),
                [k for k in shlex.split(base) if k.split("=", 1)[0] not in names] + given))
  return out


def main() -> int:
  ap = variant_parser(__doc__)
  ap.add_argument("--steps", type=int, default=10, help="timed steps per variant")
  args = ap.parse_args()
  import jax  # pylint: disable=import-outside-toplevel
  print(f"devices: {jax.devices()}", flush=True)
  rows = []
  for label, argv in variants(args.base, args.variant):
    t0 = time.perf_counter()
    try:
      row = run_variant(label, argv, args.steps)
    except Exception as e:  # noqa: BLE001 — one variant's failure is its row
      traceback.print_exc()
      row = {"label": label, "keys": " ".join(argv), "status": "error",
             "error": f"{type(e).__name__}: {e}"[:300]}
    row["wall_s"] = time.perf_counter() - t0
    print(json.dumps(row), flush=True)
    rows.append(row)
    gc.collect()
    if args.out:
      with open(args.out, "w", encoding="utf-8") as f:
        json.dump(rows, f, indent=1)
  print(table(rows), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
