"""GRPO's toy task end to end, on a CPU: a short supervised warm-up, then GRPO; prints the held-out
reward before and after GRPO (figures in benchmarks/RESULTS.md, "GRPO learns on a CPU").

    .venv/bin/python end_to_end/grpo_addition.py [--out /tmp/grpo_addition] [--sft-steps 300] \
        [--grpo-steps 150]

The task: "a+b=" → "c" for a, b in 0..29, with the prompt files shipped in
`end_to_end/data/addition/`: `prompts.jsonl` (836 pairs, one {"prompt": "12+7=", "answer": "19"}
a line: the GRPO prompts), `held_out.jsonl` (64 other pairs, never trained on: `eval_prompts`)
and `warmup.jsonl` (the 836 training pairs written out 4 times as {"text": "12+7=19"}, 60% of
them with a trailing remark, "12+7=19 ok"). `--write-data` rewrites the three files (seeded).

A model that has never seen addition (the default byte model after its README run, or any
random one) answers none of the prompts, so every group's rewards are equal and GRPO has no
signal: the reward stays 0. Hence the warm-up: `train.py` on `warmup.jsonl` teaches the format and
some arithmetic; as its data mostly carries the remark, the warmed-up model answers with it more
often than without (greedy: almost always). The reward,
`MaxText.rl.example_rewards:exact_answer` (the completion's first line must be exactly the
answer), pays only for the bare answer, so GRPO has something to learn that the warm-up did not
teach: answer plainly. The held-out reward `eval_reward` is the mean over `num_generations`
samples of each held-out prompt at the training temperature; `eval_reward_greedy` the greedy
completion's. The two commands it runs are printed, to copy.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "end_to_end", "data", "addition")
FILES = {"warmup": "warmup.jsonl", "prompts": "prompts.jsonl", "held_out": "held_out.jsonl"}
MODEL = ["emb_dim=128", "num_decoder_layers=2", "num_query_heads=4", "num_kv_heads=2",
         "head_dim=32", "mlp_dim=256", "vocab_size=264"]
REMARK = " ok"
HELD_OUT = 64


def write_data(folder: str, remark_share: float = 0.6, seed: int = 0) -> dict[str, str]:
  """The three jsonl files of the task under `folder` (what `end_to_end/data/addition/` holds)."""
  rng = random.Random(seed)
  pairs = [(a, b) for a in range(30) for b in range(30)]
  rng.shuffle(pairs)
  held_out, train = pairs[:HELD_OUT], pairs[HELD_OUT:]
  os.makedirs(folder, exist_ok=True)
  paths = {k: os.path.join(folder, name) for k, name in FILES.items()}
  with open(paths["warmup"], "w", encoding="utf-8") as f:
    for _ in range(4):
      for a, b in train:
        text = f"{a}+{b}={a + b}" + (REMARK if rng.random() < remark_share else "")
        f.write(json.dumps({"text": text}) + "\n")
  for key, chosen in (("prompts", train), ("held_out", held_out)):
    with open(paths[key], "w", encoding="utf-8") as f:
      for a, b in chosen:
        f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
  return paths


def commands(out: str, sft_steps: int, grpo_steps: int, learning_rate: str, data: str = DATA,
             extra: tuple[str, ...] = ()) -> dict[str, list[str]]:
  """The warm-up's and GRPO's command lines (run from the repository root)."""
  paths = {k: os.path.join(data, name) for k, name in FILES.items()}
  common = [*MODEL, f"base_output_directory={out}", "enable_tensorboard=false", *extra]
  py = os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(ROOT) else sys.executable
  return {
      "warmup": [py, "train.py", "configs/base.yml", *common, "run_name=warmup",
                 "max_target_length=64", "per_device_batch_size=16", "dataset_type=file",
                 f"dataset_path={paths['warmup']}", "dataset_format=jsonl", f"steps={sft_steps}",
                 "learning_rate=3e-3", "warmup_steps=20", "log_period=50", "sample_at_end=false",
                 f"checkpoint_period={sft_steps}"],
      "grpo": [py, "-m", "MaxText.rl.grpo", "configs/grpo.yml", *common, "run_name=grpo",
               f"load_parameters_path={os.path.join(out, 'warmup', 'checkpoints')}",
               "max_target_length=16", "max_new_tokens=6", f"prompts={paths['prompts']}",
               f"eval_prompts={paths['held_out']}",
               "reward=MaxText.rl.example_rewards:exact_answer", f"steps={grpo_steps}",
               "prompts_per_step=8", "num_generations=8", f"learning_rate={learning_rate}",
               "eval_reward_period=25", "log_period=25", f"checkpoint_period={grpo_steps}"]}


def run(cmd: list[str], log: str) -> float:
  print("$ " + shlex.join(cmd), flush=True)
  t0 = time.perf_counter()
  with open(log, "w", encoding="utf-8") as f:
    code = subprocess.call(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
  if code:
    sys.exit(f"{' '.join(cmd[:4])} … exited {code}; see {log}")
  return time.perf_counter() - t0


def summary(out: str) -> dict:
  """The GRPO run's rewards from its metrics.jsonl: held-out before / after, training first / last
  ten steps."""
  with open(os.path.join(out, "grpo", "metrics.jsonl"), encoding="utf-8") as f:
    rows = [json.loads(line) for line in f if line.strip()]
  evals = [r for r in rows if "eval_reward" in r]
  steps = [r for r in rows if "reward_mean" in r]
  first, last = evals[0], evals[-1]
  n = min(10, len(steps))
  return {"eval_reward_before": first["eval_reward"], "eval_reward_after": last["eval_reward"],
          "eval_reward_greedy_before": first["eval_reward_greedy"],
          "eval_reward_greedy_after": last["eval_reward_greedy"],
          "train_reward_first10": sum(r["reward_mean"] for r in steps[:n]) / n,
          "train_reward_last10": sum(r["reward_mean"] for r in steps[-n:]) / n,
          "response_length_first10": sum(r["response_length"] for r in steps[:n]) / n,
          "response_length_last10": sum(r["response_length"] for r in steps[-n:]) / n,
          "eval_curve": [(r["step"], round(r["eval_reward"], 4)) for r in evals]}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", default="/tmp/grpo_addition")
  ap.add_argument("--sft-steps", type=int, default=300)
  ap.add_argument("--grpo-steps", type=int, default=150)
  ap.add_argument("--learning-rate", default="1e-4")
  ap.add_argument("--write-data", action="store_true",
                  help=f"rewrite the task's files in {os.path.relpath(DATA, ROOT)} and stop")
  args = ap.parse_args()
  if args.write_data:
    print("\n".join(write_data(DATA).values()))
    return
  os.makedirs(args.out, exist_ok=True)
  cmds = commands(args.out, args.sft_steps, args.grpo_steps, args.learning_rate)
  sft_s = run(cmds["warmup"], os.path.join(args.out, "warmup.log"))
  grpo_s = run(cmds["grpo"], os.path.join(args.out, "grpo.log"))
  result = {"warmup_s": round(sft_s, 1), "grpo_s": round(grpo_s, 1), **summary(args.out)}
  print(f"held-out reward before -> after GRPO: greedy {result['eval_reward_greedy_before']:.3f} "
        f"-> {result['eval_reward_greedy_after']:.3f}, sampled {result['eval_reward_before']:.3f} "
        f"-> {result['eval_reward_after']:.3f} (logs in {args.out})")
  print(json.dumps(result, indent=1))


if __name__ == "__main__":
  main()
