"""An outside GRPO loop on the policy API: what an RL team's controller does with the trainer as its
policy backend, with nothing of MaxText but `MaxText.rl.policy`, the decoding engine and a reward
function. It reproduces `python -m MaxText.rl.grpo` (the same command line: config, prompts,
reward) step for step: the same prompts, completions, rewards and losses, bit for bit, on one
process (tests/test_rl_driver.py).

    .venv/bin/python end_to_end/rl_driver.py configs/grpo.yml load_parameters_path=CKPT \
        prompts=end_to_end/data/addition/prompts.jsonl \
        reward=MaxText.rl.example_rewards:exact_answer max_target_length=16 max_new_tokens=6 \
        prompts_per_step=8 num_generations=8 steps=3 run_name=driver

prints one JSON line per step (step, reward_mean, reward_std, loss, kl, grad_norm) and saves the
policy at the end (train.py's checkpoint format); a rerun resumes from it. `--offload` (first):
the optimizer state leaves the devices while the engine samples (`policy.offload()`). SIGTERM:
the step in progress ends, is saved, and the driver exits 42, as train.py does. A step:
  1. the step's prompts: positions (step-1)·P … step·P-1 of the epochs' permutations seeded by
     (seed, epoch) (the order `MaxText.rl.grpo` documents, docs/rl.md);
  2. G completions of each from the engine on the policy's mesh and current parameters
     (co-located), row j of step s sampled with the key (seed, (s-1)·N + j);
  3. the reward of each (the completion's text without its eos), the group advantages;
  4. the batch: input_ids / token_mask / generation_mask, advantages, the old log-probabilities
     (`policy.logprobs`) and, when there is a KL term, the reference's;
  5. `num_iterations` × `policy.train(batch)`.
Errors end the process with train.py's exit statuses (`exit_status`).
"""
from __future__ import annotations

import importlib
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from MaxText.decoding.engine import Engine  # noqa: E402
from MaxText.decoding.sampling import Sampling  # noqa: E402
from MaxText.rl.policy import EXIT_PREEMPTED, Policy, exit_status, group_advantages  # noqa: E402


def reward_function(spec: str):
  module, _, name = spec.partition(":")
  return getattr(importlib.import_module(module), name)


def prompts_of_step(n: int, seed: int, step: int, per_step: int) -> list[int]:
  return [int(np.random.default_rng([seed, k // n]).permutation(n)[k % n])
          for k in range((step - 1) * per_step, step * per_step)]


def batch_of(prompts: list[list[int]], completions, seq: int) -> dict[str, np.ndarray]:
  N = len(prompts)
  out = {k: np.zeros((N, seq), np.int32) for k in ("input_ids", "token_mask", "generation_mask")}
  for j, (p, c) in enumerate(zip(prompts, completions)):
    row = list(p) + list(c.output_ids)
    out["input_ids"][j, :len(row)] = row
    out["token_mask"][j, :len(row)] = 1
    out["generation_mask"][j, len(p):len(row)] = 1
  return out


def run(argv: list[str], on_step=print, offload: bool = False) -> tuple[int, list[dict]]:
  """The loop on `argv` (MaxText.rl.grpo's command line) → (exit status, one dict per step)."""
  policy = Policy.load(argv)
  try:
    cfg = policy.cfg
    reward = reward_function(cfg.reward)
    with open(os.path.expanduser(cfg.prompts), encoding="utf-8") as f:
      rows = [json.loads(line) for line in f if line.strip()]
    ids = [policy.io.encode(r) for r in rows]
    texts = [r["prompt"] if isinstance(r.get("prompt"), str) else policy.io.text(i)
             for r, i in zip(rows, ids)]
    G, N, S = cfg.num_generations, cfg.prompts_per_step * cfg.num_generations, \
        cfg.max_target_length
    engine = Engine(policy.model_config, policy.mesh, policy.rules, cache_dtype=cfg.cache_dtype,
                    batch_size=N, max_cache_length=S)
    sampling = Sampling(cfg.temperature, cfg.top_k, cfg.top_p, cfg.min_p, cfg.seed)
    eos = list(policy.io.eos_ids)
    with_reference = cfg.kl_beta > 0 or cfg.lora_rank > 0
    out = []
    with policy.preemption() as watch:
      for step in range((policy.latest_checkpoint() or 0) + 1, cfg.steps + 1):
        idx = [i for i in prompts_of_step(len(rows), cfg.seed, step, cfg.prompts_per_step)
               for _ in range(G)]
        prompts = [ids[i] for i in idx]
        if offload:
          policy.offload()
        done = engine.generate(policy.params, prompts, max_new_tokens=cfg.max_new_tokens,
                               sampling=sampling, eos_ids=eos, stop=list(cfg.stop),
                               detokenize=policy.io.text,
                               row_ids=range((step - 1) * N, step * N))
        if offload:
          policy.onload()
        completions = [policy.io.text(c.output_ids[:-1] if c.finish_reason == "eos" and
                                      c.output_ids[-1] in eos else c.output_ids) for c in done]
        rewards = np.array([float(reward(texts[i], c, rows[i]))
                            for i, c in zip(idx, completions)], np.float32)
        batch = batch_of(prompts, done, S)
        batch["advantages"] = np.asarray(group_advantages(rewards, G, cfg.advantage_estimator))
        batch["old_logprobs"] = policy.logprobs(batch)
        if with_reference:
          batch["reference_logprobs"] = policy.reference_logprobs(batch)
        passes = [policy.train(batch) for _ in range(cfg.num_iterations)]
        row = {"step": step, "reward_mean": float(rewards.mean()),
               "reward_std": float(rewards.std()),
               **{k: float(np.mean([p[k] for p in passes])) for k in ("loss", "grad_norm")}}
        if "kl" in passes[0]:
          row["kl"] = float(np.mean([p["kl"] for p in passes]))
        on_step(json.dumps(row))
        out.append(row)
        if watch.should_stop(step) and step < cfg.steps:
          if cfg.enable_checkpointing:
            policy.save(step)   # the update count is the step: num_iterations per step
          print(f"preempted ({watch.signal_name}): step {step} saved; exit {EXIT_PREEMPTED}",
                file=sys.stderr)
          return EXIT_PREEMPTED, out
    if cfg.enable_checkpointing and out:
      policy.save(cfg.steps)
    return 0, out
  finally:
    policy.close()


def main() -> int:
  args = sys.argv[1:]
  offload = args[:1] == ["--offload"]
  try:
    return run(args[offload:], offload=offload)[0]
  except Exception as e:  # pylint: disable=broad-except
    code = exit_status(e)
    if code == 1:
      raise
    print(f"error: {e}", file=sys.stderr)
    return code


if __name__ == "__main__":
  sys.exit(main())
