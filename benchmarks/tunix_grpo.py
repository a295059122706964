"""GRPO steps on this CPU with Tunix (google-tunix, in its own venv) and with ours, side by side:
the same tiny Qwen3 shape (configs/models/qwen3-tiny.yml: 2 layers, emb 64, 4 heads of 32, kv 2,
mlp 128, vocab 384, random init), the toy task's prompts (end_to_end/data/addition/prompts.jsonl)
and reward (exact answer), the same byte tokenizer, group size, lengths, full fine-tuning, AdamW,
fp32, one device. Prints the median over the steps after the first two of the seconds from one
step to the next, and of the rollout's seconds (Tunix: its `RLCluster.generate` call; ours:
`rollout_time_s`), with the rollout's tokens per second (G x prompts x max_new_tokens a step: a
random model runs to the limit).

    /work/tunix/venv/bin/python benchmarks/tunix_grpo.py --trainer tunix   # Tunix's venv
    .venv/bin/python benchmarks/tunix_grpo.py --trainer ours               # ours

(Tunix's venv: python -m venv /work/tunix/venv && /work/tunix/venv/bin/pip install
google-tunix==0.1.7.)
"""
from __future__ import annotations

import argparse
import json
import statistics
import os
import subprocess
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = os.path.join(ROOT, "end_to_end", "data", "addition", "prompts.jsonl")
G, P, NEW, SEQ, LR = 4, 4, 6, 16, 1e-4   # group, prompts per step, new tokens, sequence, lr


def prompts() -> list[dict]:
  with open(PROMPTS, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


class Bytes:
  """Our byte tokenizer (MaxText/data/tokenizers.py: ByteTokenizer) in Tunix's interface."""
  def encode(self, text, **_):
    if not isinstance(text, str):   # Tunix hands a prompt over as a 0-d NumPy string array
      text = str(text.item())
    return [1] + [b + 3 for b in text.encode("utf-8")]

  def decode(self, ids, **_):
    return bytes(int(i) - 3 for i in ids if 3 <= int(i) < 259).decode("utf-8", "replace")

  def bos_id(self):
    return 1

  def eos_id(self):
    return 2

  def pad_id(self):
    return 0


def exact(prompts, completions, answer, **_):
  del prompts
  return [1.0 if c.split("\n")[0].strip() == a else 0.0 for c, a in zip(completions, answer)]


def tunix(steps: int) -> dict:
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from tunix.models.qwen3 import model as qwen3  # pylint: disable=import-outside-toplevel
  from tunix.rl import rl_cluster as rl  # pylint: disable=import-outside-toplevel
  from tunix.rl.grpo import grpo_learner  # pylint: disable=import-outside-toplevel
  from tunix.rl.rollout import base_rollout  # pylint: disable=import-outside-toplevel
  cfg = qwen3.ModelConfig(num_layers=2, vocab_size=384, embed_dim=64, hidden_dim=128, num_heads=4,
                          head_dim=32, num_kv_heads=2, rope_theta=1_000_000, norm_eps=1e-6)
  auto = jax.sharding.AxisType.Auto   # Tunix's models index with auto sharding
  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(auto, auto))
  with mesh:
    actor = qwen3.Qwen3(cfg, rngs=nnx.Rngs(0))
    reference = qwen3.Qwen3(cfg, rngs=nnx.Rngs(0))
  cluster = rl.RLCluster(
      actor=actor, reference=reference, tokenizer=Bytes(),
      cluster_config=rl.ClusterConfig(
          role_to_mesh={rl.Role.ACTOR: mesh, rl.Role.REFERENCE: mesh, rl.Role.ROLLOUT: mesh},
          rollout_engine="vanilla", offload_to_cpu=False,
          training_config=rl.RLTrainingConfig(actor_optimizer=optax.adamw(LR, weight_decay=0.0),
                                              eval_every_n_steps=10_000, max_steps=steps),
          rollout_config=base_rollout.RolloutConfig(max_tokens_to_generate=NEW,
                                                    max_prompt_length=SEQ - NEW,
                                                    kv_cache_size=SEQ + 8, temperature=1.0,
                                                    eos_tokens=[2])))
  learner = grpo_learner.GRPOLearner(
      rl_cluster=cluster, reward_fns=[exact],
      algo_config=grpo_learner.GRPOConfig(num_generations=G, num_iterations=1, beta=0.0,
                                          epsilon=0.2, loss_agg_mode="token-mean"))
  rows = prompts()
  rng = np.random.default_rng(0)

  def data():
    for _ in range(steps):
      idx = rng.permutation(len(rows))[:P]
      yield {"prompts": np.array([rows[i]["prompt"] for i in idx]),   # arrays: Tunix repeats
             "answer": np.array([rows[i]["answer"] for i in idx])}    # each leaf G times

  calls, generate = [], cluster.generate

  def timed_generate(*a, **kw):   # one rollout per GRPO step: its start and its end
    t0 = time.perf_counter()
    out = generate(*a, **kw)
    calls.append((t0, time.perf_counter()))
    return out
  cluster.generate = timed_generate
  learner.train(data())
  return {"step_time_s": [b[0] - a[0] for a, b in zip(calls, calls[1:])],
          "rollout_time_s": [b - a for a, b in calls]}


def ours(steps: int, out: str) -> dict:
  cmd = [sys.executable, "-m", "MaxText.rl.grpo", os.path.join(ROOT, "configs", "grpo.yml"),
         "model_name=qwen3-tiny", "tokenizer_type=byte", f"prompts={PROMPTS}",
         "reward=MaxText.rl.example_rewards:exact_answer", f"num_generations={G}",
         f"prompts_per_step={P}", f"max_new_tokens={NEW}", f"max_target_length={SEQ}",
         f"learning_rate={LR}", "dtype=float32", f"steps={steps}", "enable_checkpointing=false",
         "enable_tensorboard=false", f"base_output_directory={out}", "run_name=ours"]
  subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), check=True,
                 capture_output=True)
  with open(os.path.join(out, "ours", "metrics.jsonl"), encoding="utf-8") as f:
    rows = [json.loads(line) for line in f if line.strip()]
  rows = [r for r in rows if "step_time_s" in r]
  return {k: [r[k] for r in rows] for k in ("step_time_s", "rollout_time_s")}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--trainer", choices=("tunix", "ours"), required=True)
  ap.add_argument("--steps", type=int, default=12)
  ap.add_argument("--out", default="/tmp/tunix_grpo")
  args = ap.parse_args()
  r = tunix(args.steps) if args.trainer == "tunix" else ours(args.steps, args.out)
  step, rollout = (statistics.median(r[k][2:]) for k in ("step_time_s", "rollout_time_s"))
  print(json.dumps({"trainer": args.trainer, "steps_timed": len(r["step_time_s"][2:]),
                    "s_per_step": round(step, 4), "rollout_s": round(rollout, 4),
                    "rollout_tokens_per_s": round(G * P * NEW / rollout, 1)}))


if __name__ == "__main__":
  main()
