"""GRPO learns on a CPU: a toy verifiable task, a short supervised warm-up, then GRPO; prints the
held-out reward before and after (figures in benchmarks/RESULTS.md).

    .venv/bin/python benchmarks/grpo_demo.py [--out /tmp/grpo_demo] [--sft-steps 300] \
        [--grpo-steps 150]

The task: "a+b=" → "c" for a, b in 0..29 (900 pairs; 64 held out for evaluation, never trained
on). The warm-up data writes 60% of its answers with a trailing remark ("12+7=19 ok"), so the
warmed-up model answers with the remark more often than without (greedy: always); the reward is
`MaxText.rl.example_rewards:exact_answer` (the completion's first line must be exactly the
answer), so it pays only for the bare answer. GRPO then has something to learn that the warm-up
did not teach: answer plainly (and it keeps whatever arithmetic it knows). The held-out reward
`eval_reward` is the mean over 8 samples of each held-out prompt at the training temperature;
`eval_reward_greedy` the greedy completion's.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ["emb_dim=128", "num_decoder_layers=2", "num_query_heads=4", "num_kv_heads=2",
         "head_dim=32", "mlp_dim=256", "vocab_size=264"]
REMARK = " ok"


def write_data(out: str, remark_share: float, seed: int = 0) -> dict[str, str]:
  rng = random.Random(seed)
  pairs = [(a, b) for a in range(30) for b in range(30)]
  rng.shuffle(pairs)
  held_out, train = pairs[:64], pairs[64:]
  paths = {k: os.path.join(out, f"{k}.jsonl") for k in ("sft", "prompts", "eval_prompts")}
  with open(paths["sft"], "w", encoding="utf-8") as f:
    for _ in range(4):
      for a, b in train:
        text = f"{a}+{b}={a + b}" + (REMARK if rng.random() < remark_share else "")
        f.write(json.dumps({"text": text}) + "\n")
  for key, chosen in (("prompts", train), ("eval_prompts", held_out)):
    with open(paths[key], "w", encoding="utf-8") as f:
      for a, b in chosen:
        f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
  return paths


def run(cmd: list[str], log: str) -> float:
  t0 = time.perf_counter()
  with open(log, "w", encoding="utf-8") as f:
    code = subprocess.call(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
  if code:
    sys.exit(f"{' '.join(cmd[:4])} … exited {code}; see {log}")
  return time.perf_counter() - t0


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", default="/tmp/grpo_demo")
  ap.add_argument("--sft-steps", type=int, default=300)
  ap.add_argument("--grpo-steps", type=int, default=150)
  ap.add_argument("--learning-rate", default="1e-4")
  ap.add_argument("--remark-share", type=float, default=0.6)
  args = ap.parse_args()
  os.makedirs(args.out, exist_ok=True)
  paths = write_data(args.out, args.remark_share)
  py = sys.executable
  common = [*MODEL, f"base_output_directory={args.out}", "enable_tensorboard=false"]
  sft_s = run([py, "train.py", "configs/base.yml", *common, "run_name=sft", "max_target_length=64",
               "per_device_batch_size=16", "dataset_type=file", f"dataset_path={paths['sft']}",
               "dataset_format=jsonl", f"steps={args.sft_steps}", "learning_rate=3e-3",
               "warmup_steps=20", "log_period=50", "sample_at_end=false",
               f"checkpoint_period={args.sft_steps}"], os.path.join(args.out, "sft.log"))
  grpo_s = run([py, "-m", "MaxText.rl.grpo", "configs/grpo.yml", *common, "run_name=grpo",
                f"load_parameters_path={os.path.join(args.out, 'sft', 'checkpoints')}",
                "max_target_length=16", "max_new_tokens=6", f"prompts={paths['prompts']}",
                f"eval_prompts={paths['eval_prompts']}",
                "reward=MaxText.rl.example_rewards:exact_answer", f"steps={args.grpo_steps}",
                "prompts_per_step=8", "num_generations=8", f"learning_rate={args.learning_rate}",
                "eval_reward_period=25", "log_period=25",
                f"checkpoint_period={args.grpo_steps}"], os.path.join(args.out, "grpo.log"))
  with open(os.path.join(args.out, "grpo", "metrics.jsonl"), encoding="utf-8") as f:
    rows = [json.loads(line) for line in f if line.strip()]
  evals = [r for r in rows if "eval_reward" in r]
  steps = [r for r in rows if "reward_mean" in r]
  first, last = evals[0], evals[-1]
  compute = {}
  for name in ("sft", "grpo"):
    with open(os.path.join(args.out, name, "config.yml"), encoding="utf-8") as f:
      compute[name] = yaml.safe_load(f)["dtype"]
  result = {"sft_s": round(sft_s, 1), "grpo_s": round(grpo_s, 1), "compute_dtype": compute,
            "eval_reward_before": first["eval_reward"], "eval_reward_after": last["eval_reward"],
            "eval_reward_greedy_before": first["eval_reward_greedy"],
            "eval_reward_greedy_after": last["eval_reward_greedy"],
            "train_reward_first10": sum(r["reward_mean"] for r in steps[:10]) / 10,
            "train_reward_last10": sum(r["reward_mean"] for r in steps[-10:]) / 10,
            "response_length_first10": sum(r["response_length"] for r in steps[:10]) / 10,
            "response_length_last10": sum(r["response_length"] for r in steps[-10:]) / 10,
            "eval_curve": [(r["step"], round(r["eval_reward"], 4)) for r in evals]}
  print(json.dumps(result, indent=1))


if __name__ == "__main__":
  main()
