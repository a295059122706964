"""Distillation end to end on a CPU: a teacher trained here on the embedded data (train.py), then a
smaller student trained the same number of steps on the same rows twice — plainly (train.py) and
distilled from the teacher (python -m MaxText.distill) — and the held-out eval_loss of each
printed (figures in benchmarks/RESULTS.md, "Distillation on a CPU").

    .venv/bin/python end_to_end/distill_compare.py [--out /tmp/distill_compare] \
        [--teacher-steps 400] [--student-steps 150] [--distill-loss forward_kl] [--reuse-teacher]

Both student runs start from the same random init (same seed, same architecture), read the same
batches (same data seed) and evaluate on the same held-out documents (`eval_split_fraction`: the
training stream never reads them); the only difference is the loss. The commands it runs are
printed, to copy.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = os.path.join(ROOT, ".venv", "bin", "python")
DATA = ["max_target_length=128", "per_device_batch_size=8", "eval_split_fraction=0.02",
        "eval_steps=8", "sample_at_end=false", "enable_tensorboard=false", "log_period=25",
        "vocab_size=264", "dtype=float32"]
TEACHER = ["emb_dim=192", "num_decoder_layers=4", "num_query_heads=4", "num_kv_heads=4",
           "head_dim=48", "mlp_dim=768"]
STUDENT = ["emb_dim=64", "num_decoder_layers=2", "num_query_heads=4", "num_kv_heads=2",
           "head_dim=16", "mlp_dim=192"]


def commands(out: str, teacher_steps: int, student_steps: int, loss: str, alpha: str,
             temperature: str) -> dict[str, list[str]]:
  base = [os.path.join(ROOT, "configs", "base.yml"), *DATA, f"base_output_directory={out}"]
  teacher = [PY, os.path.join(ROOT, "train.py"), *base, *TEACHER, "run_name=teacher",
             f"steps={teacher_steps}", f"eval_period={teacher_steps}",
             f"checkpoint_period={teacher_steps}"]
  student = [*base, *STUDENT, f"steps={student_steps}", "learning_rate=3e-3",
             f"eval_period={max(student_steps // 3, 1)}", f"checkpoint_period={student_steps}"]
  plain = [PY, os.path.join(ROOT, "train.py"), *student, "run_name=plain"]
  distill = [PY, "-m", "MaxText.distill", *student, "run_name=distill",
             f"teacher_path={os.path.join(out, 'teacher', 'checkpoints')}",
             f"distill_loss={loss}", f"distill_alpha={alpha}", f"distill_temperature={temperature}"]
  return {"teacher": teacher, "plain": plain, "distill": distill}


def run(cmd: list[str]) -> float:
  print("$ " + " ".join(cmd), flush=True)
  t0 = time.perf_counter()
  subprocess.run(cmd, check=True, cwd=ROOT)
  return time.perf_counter() - t0


def evals(out: str, name: str) -> list[tuple[int, float]]:
  with open(os.path.join(out, name, "metrics.jsonl"), encoding="utf-8") as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", default="/tmp/distill_compare")
  ap.add_argument("--teacher-steps", type=int, default=400)
  ap.add_argument("--student-steps", type=int, default=150)
  ap.add_argument("--distill-loss", default="forward_kl")
  ap.add_argument("--alpha", default="0.5")
  ap.add_argument("--temperature", default="1.0")
  ap.add_argument("--reuse-teacher", action="store_true")
  args = ap.parse_args()
  cmds = commands(args.out, args.teacher_steps, args.student_steps, args.distill_loss,
                  args.alpha, args.temperature)
  times = {}
  for name in ("teacher", "plain", "distill"):
    if name == "teacher" and args.reuse_teacher:
      continue
    if name != "teacher":
      subprocess.run(["rm", "-rf", os.path.join(args.out, name)], check=True)
    times[name] = run(cmds[name])
  summary = {name: evals(args.out, name) for name in ("teacher", "plain", "distill")}
  summary["wall_s"] = times
  print(json.dumps(summary))
  plain, distill = summary["plain"][-1][1], summary["distill"][-1][1]
  print(f"held-out eval_loss after {args.student_steps} steps: plain {plain:.4f}, distilled "
        f"{distill:.4f} (teacher {summary['teacher'][-1][1]:.4f})")
  sys.exit(0 if distill < plain else 1)


if __name__ == "__main__":
  main()
