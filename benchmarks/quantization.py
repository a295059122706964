"""Post-training quantization and quantized training, measured side by side in one run (the commands
are the user's: train.py, MaxText.quantize, MaxText.evaluate, MaxText.decode).

  .venv/bin/python benchmarks/quantization.py [--out /tmp/qbench] [--steps 150] [--qat-steps 40]
      [--model qwen3-moe-tiny] [--keep-float experts]

1. Trains the default model (configs/base.yml: 4 layers, d 256, embedded data) for --steps with
   eval_split_fraction=0.05 (the held-out documents are never read by training or calibration),
   computing as train.py does by default (dtype=auto: bf16, fp32 weights; printed with the table).
2. Quantizes it: int8 RTN, int4 RTN, int4 GPTQ with and without act-order (group 64, 8
   calibration batches of training documents).
3. Per checkpoint: held-out perplexity (MaxText.evaluate, eval_steps=10), the params item's size on
   disk, generated tokens/s (MaxText.inference: 8 prompts x 64 new tokens, greedy, no eos; timed on
   the second call, the first compiles).
4. Quantized training: int8 QAT vs the same config in bf16 (--qat-steps each): median step time
   (steps after the 5th) and the loss at a few steps.
--model NAME: configs/models/NAME.yml instead of the default model (e.g. qwen3-moe-tiny).
--keep-float REGEX: also int8 / int4 RTN with `weight_quant_exclude=REGEX` (e.g. "experts": the
   checkpoints MaxText.quantize wrote before it quantized routed experts).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
DATA = ["eval_split_fraction=0.05"]


def run(args: list[str]) -> str:
  print("$", " ".join(args), flush=True)
  res = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, check=False)
  if res.returncode:
    sys.exit(f"failed ({res.returncode}): {' '.join(args)}\n{res.stderr[-3000:]}")
  return res.stdout + res.stderr


def du(path: str) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


PROMPTS = ["def main(", "import os", "class Foo", "for i in", "The ", "return x", "if x ==",
           "while True"]


def decode_speed(path: str) -> float:
  """Generated tokens/s of `inference.load(path)`: 8 prompts x 64 new tokens (no eos), greedy,
  timed on a second call (the first compiles)."""
  sys.path.insert(0, ROOT)
  from MaxText import inference  # pylint: disable=import-outside-toplevel
  model = inference.load(["configs/base.yml", f"load_parameters_path={path}",
                          "decode_batch_size=8"])
  never = [model.cfg.vocab_size - 1]   # an id the byte tokenizer never produces: no early stop
  model.generate(PROMPTS, max_new_tokens=64, eos_ids=never)
  t = time.perf_counter()
  out = model.generate(PROMPTS, max_new_tokens=64, eos_ids=never)
  return sum(len(g.output_ids) for g in out) / (time.perf_counter() - t)


def main() -> None:
  if len(sys.argv) == 3 and sys.argv[1] == "--decode-speed":
    print(decode_speed(sys.argv[2]))
    return
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="/tmp/qbench")
  ap.add_argument("--steps", type=int, default=150)
  ap.add_argument("--qat-steps", type=int, default=40)
  ap.add_argument("--model", default="", help="configs/models/<name>.yml (default: the default)")
  ap.add_argument("--keep-float", default="", help="extra RTN rows with weight_quant_exclude=this")
  ap.add_argument("--reuse", action="store_true", help="keep the checkpoints of an earlier run in "
                  "--out (train and quantize only what is missing); 0 --qat-steps: no QAT runs")
  a = ap.parse_args()
  if not a.reuse:
    shutil.rmtree(a.out, ignore_errors=True)
  common = [f"base_output_directory={a.out}"] + ([f"model_name={a.model}"] if a.model else [])
  if not os.path.isdir(f"{a.out}/fp/checkpoints"):
    run([PY, "train.py", "configs/base.yml", "run_name=fp", f"steps={a.steps}",
         f"checkpoint_period={a.steps}", "eval_period=100000", *DATA, *common])
  fp = f"{a.out}/fp/checkpoints"
  ckpts = {"fp32": fp}
  kept = [f"weight_quant_exclude={a.keep_float}"]
  keep = [] if not a.keep_float else [
      (f"int8 RTN ({a.keep_float} float)", ["method=rtn", "bits=8", *kept]),
      (f"int4 RTN g64 ({a.keep_float} float)", ["method=rtn", "bits=4", "group_size=64", *kept])]
  for name, args in [*keep, ("int8 RTN", ["method=rtn", "bits=8"]),
                     ("int4 RTN g64", ["method=rtn", "bits=4", "group_size=64"]),
                     ("int4 GPTQ g64", ["method=gptq", "bits=4", "group_size=64",
                                        "calibration_steps=8", "act_order=false"]),
                     ("int4 GPTQ g64 act-order", ["method=gptq", "bits=4", "group_size=64",
                                                  "calibration_steps=8", "act_order=true"])]:
    path = f"{a.out}/" + re.sub(r"\W+", "_", name)
    ckpts[name] = path
    if os.path.isdir(path):
      continue
    t = time.time()
    run([PY, "-m", "MaxText.quantize", "configs/base.yml", f"load_parameters_path={fp}",
         f"output_path={path}", *args, *DATA, *common, "run_name=calib"])
    print(f"  quantized in {time.time() - t:.1f} s")
  rows = []
  for name, path in ckpts.items():
    out = run([PY, "-m", "MaxText.evaluate", "configs/base.yml", f"load_parameters_path={path}",
               *DATA, "eval_steps=10", *common, "run_name=eval"])
    ppl = float(out.strip().splitlines()[-1].split("eval_perplexity=")[1].split()[0])
    step = sorted(int(s) for s in os.listdir(path) if s.isdigit())[-1]
    size = du(os.path.join(path, str(step), "params"))
    tps = float(run([PY, __file__, "--decode-speed", path]).strip().splitlines()[-1])
    rows.append((name, ppl, size, tps))
  base = rows[0][1]
  with open(f"{a.out}/fp/config.yml", encoding="utf-8") as f:
    trained = yaml.safe_load(f)
  print(f"\nthe float checkpoint trained {a.steps} steps computing in {trained['dtype']} (weights "
        f"{trained['weight_dtype']}); evaluation and decoding compute in float32 (the tools' dtype)")
  print("\n| checkpoint | held-out perplexity | vs fp32 | params on disk | generated tok/s (8 prompts x 64 "
        "new, greedy, after a compiling call) |")
  print("|---|---|---|---|---|")
  for name, ppl, size, tps in rows:
    print(f"| {name} | {ppl:.4f} | {100 * (ppl / base - 1):+.2f}% | {size / 2**20:.2f} MiB | "
          f"{tps:.0f} |")
  if not a.qat_steps:
    return
  qat = {}
  for name, extra in [("bf16", []), ("bf16 + int8 QAT", ["quantization=int8"])]:
    run_name = re.sub(r"\W+", "_", name)
    run([PY, "train.py", "configs/base.yml", f"run_name={run_name}", f"steps={a.qat_steps}",
         "dtype=bfloat16", "enable_checkpointing=false", "log_period=1", *DATA, *common, *extra])
    with open(f"{a.out}/{run_name}/metrics.jsonl", encoding="utf-8") as f:
      m = [json.loads(l) for l in f if l.strip()]
    m = [r for r in m if "loss" in r and "step_time_s" in r] or m
    qat[name] = m
  print("\n| training (bf16 compute) | median step s (after step 5) | loss at steps 1 / 10 / 20 / last |")
  print("|---|---|---|")
  for name, m in qat.items():
    times = [r.get("step_time_s") for r in m[5:] if r.get("step_time_s")]
    by = {r["step"]: r["loss"] for r in m}
    pick = [by.get(s) for s in (1, 10, 20, max(by))]
    print(f"| {name} | {statistics.median(times) if times else float('nan'):.3f} | "
          + " / ".join(f"{x:.3f}" if x is not None else "-" for x in pick) + " |")


if __name__ == "__main__":
  main()
