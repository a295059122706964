"""DPO end to end on a CPU: a tiny model warmed up on addition (GRPO's warm-up,
end_to_end/grpo_addition.py), then DPO on preferences "correct answer" over "wrong answer"; prints
the held-out pairs' rewards/accuracies before and after (figures in benchmarks/RESULTS.md, "DPO
learns on a CPU").

    .venv/bin/python end_to_end/dpo_addition.py [--out /tmp/dpo_addition] [--sft-steps 300] \
        [--dpo-steps 100] [--dpo-loss sigmoid]

The preferences are written by `write_preferences` (seeded): for each prompt of
`end_to_end/data/addition/prompts.jsonl` (training) and `held_out.jsonl` (64 sums never trained
on), {"prompt": "12+7=", "chosen": "19", "rejected": W} with W a wrong answer within ±3 of the
right one. rewards/accuracies is the share of pairs whose implicit reward β (log π - log π_ref) is
higher for the right answer than for the wrong one; the reference is the warmed-up model, so it
is 0 before the first step (every reward is 0) and rises when DPO moves the policy towards right
answers — on the held-out sums too when it learned arithmetic, not the training pairs. The
two commands it runs are printed, to copy.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from grpo_addition import DATA, FILES, MODEL, ROOT, commands as grpo_commands, run  # noqa: E402


def write_preferences(src: str, dst: str, seed: int = 0) -> str:
  """One preference pair per {"prompt", "answer"} line of `src` → `dst`."""
  rng = random.Random(seed)
  with open(src, encoding="utf-8") as f, open(dst, "w", encoding="utf-8") as out:
    for line in f:
      row = json.loads(line)
      c = int(row["answer"])
      wrong = rng.choice([w for w in range(c - 3, c + 4) if w != c and w >= 0])
      out.write(json.dumps({"prompt": row["prompt"], "chosen": str(c),
                            "rejected": str(wrong)}) + "\n")
  return dst


def commands(out: str, sft_steps: int, dpo_steps: int, loss: str, learning_rate: str,
             beta: str, extra: tuple[str, ...] = ()) -> dict[str, list[str]]:
  """The warm-up's and DPO's command lines (run from the repository root)."""
  warmup = grpo_commands(out, sft_steps, 1, "0", extra=extra)["warmup"]
  dpo = [warmup[0], "-m", "MaxText.dpo", "configs/dpo.yml", *MODEL, f"base_output_directory={out}",
         "enable_tensorboard=false", "run_name=dpo",
         f"load_parameters_path={os.path.join(out, 'warmup', 'checkpoints')}",
         "max_target_length=16", f"preferences={os.path.join(out, 'train_pairs.jsonl')}",
         f"eval_preferences={os.path.join(out, 'held_out_pairs.jsonl')}", f"dpo_loss={loss}",
         f"beta={beta}", f"steps={dpo_steps}", "per_device_batch_size=8",
         f"learning_rate={learning_rate}", "eval_preferences_period=25", "log_period=25",
         f"checkpoint_period={dpo_steps}", *extra]
  return {"warmup": warmup, "dpo": dpo}


def summary(out: str) -> dict:
  with open(os.path.join(out, "dpo", "metrics.jsonl"), encoding="utf-8") as f:
    rows = [json.loads(line) for line in f if line.strip()]
  evals = [r for r in rows if "eval/rewards/accuracies" in r]
  steps = [r for r in rows if "rewards/accuracies" in r]
  n = min(10, len(steps))
  mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)
  return {"eval_accuracy_before": evals[0]["eval/rewards/accuracies"],
          "eval_accuracy_after": evals[-1]["eval/rewards/accuracies"],
          "eval_margin_after": evals[-1]["eval/rewards/margins"],
          "train_accuracy_first10": mean(steps[:n], "rewards/accuracies"),
          "train_accuracy_last10": mean(steps[-n:], "rewards/accuracies"),
          "eval_curve": [(r["step"], round(r["eval/rewards/accuracies"], 4)) for r in evals]}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", default="/tmp/dpo_addition")
  ap.add_argument("--sft-steps", type=int, default=300)
  ap.add_argument("--dpo-steps", type=int, default=100)
  ap.add_argument("--dpo-loss", default="sigmoid")
  ap.add_argument("--beta", default="0.1")
  ap.add_argument("--learning-rate", default="1e-4")
  ap.add_argument("--reuse-warmup", action="store_true",
                  help="keep OUT/warmup when it holds a checkpoint (another --dpo-loss)")
  args = ap.parse_args()
  os.makedirs(args.out, exist_ok=True)
  write_preferences(os.path.join(DATA, FILES["prompts"]), os.path.join(args.out,
                                                                        "train_pairs.jsonl"))
  write_preferences(os.path.join(DATA, FILES["held_out"]),
                    os.path.join(args.out, "held_out_pairs.jsonl"), seed=1)
  cmds = commands(args.out, args.sft_steps, args.dpo_steps, args.dpo_loss, args.learning_rate,
                  args.beta)
  result = {}
  if not (args.reuse_warmup and os.path.isdir(os.path.join(args.out, "warmup", "checkpoints"))):
    result["warmup_s"] = round(run(cmds["warmup"], os.path.join(args.out, "warmup.log")), 1)
  run_dir = os.path.join(args.out, "dpo")
  if os.path.isdir(run_dir):
    os.rename(run_dir, f"{run_dir}.{len(os.listdir(args.out))}")   # a fresh DPO run each time
  result["dpo_s"] = round(run(cmds["dpo"], os.path.join(args.out, "dpo.log")), 1)
  result.update(summary(args.out))
  print(f"held-out rewards/accuracies before -> after {args.dpo_loss}: "
        f"{result['eval_accuracy_before']:.3f} -> {result['eval_accuracy_after']:.3f} "
        f"(logs in {args.out})")
  print(json.dumps(result, indent=1))


if __name__ == "__main__":
  assert ROOT
  main()
