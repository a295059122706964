"""Chunked prefill and prefix caching in the server's engine (MaxText/serve/scheduler.py over
MaxText/decoding/slots.py), in this process, per family, each pair side by side in one run.

  .venv/bin/python benchmarks/serve_prefill.py [--family gemma4] [--prompt 1024] [--rounds 2]
      [--set emb_dim=256 ...]

The model is the family's tiny preset (configs/models/<family>-tiny.yml) with `--set` overrides,
random weights (our init, seed 0), fp32, one CPU device, 4 slots.
- Stall: two requests decode (16-token prompts, up to 256 tokens); a newcomer with a
  `--prompt`-token prompt arrives. Whole-prompt prefill (serve_prefill_chunk=0) against pieces of 128 tokens: the longest
  wait between two deliveries of a running request while the newcomer is prefilled, and the
  newcomer's time to first token.
- Prefix: a `--prompt`-token request runs 8 tokens, then its conversation's next turn (its prompt,
  its answer, 16 new tokens) arrives alone: its time to first token without prefix caching and
  with it (serve_prefix_cache=16: the next turn reuses the first request's row). Greedy tokens of
  the two modes are compared.
An untimed warm-up round of each mode compiles its programs; then `--rounds` rounds, the modes
interleaved within each round, so they share the machine's load.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


class Sink:
  """A job's deliveries: their times, its tokens, `first` and `done` events."""

  def __init__(self):
    self.times, self.ids = [], []
    self.first, self.done = threading.Event(), threading.Event()

  def __call__(self, d):
    self.times.append(time.perf_counter())
    self.ids += d.ids
    self.first.set()
    if d.finish_reason is not None:
      self.done.set()


def stall(env, chunk: int, prompt: list[int], runners: list[list[int]],
          warm_up: bool = False) -> tuple[float, float]:
  """(longest wait between two deliveries of a running request from the newcomer's arrival to
  the first delivery after its first token, the newcomer's time to first token), seconds. `warm_up`: the runners then run to
  their end (every decoding window compiled) instead of being cancelled."""
  from MaxText.serve.scheduler import Job, Scheduler
  sched = Scheduler(env.model, env.slots, 16, prefill_chunk=chunk)
  sinks = [Sink() for _ in runners]
  jobs = [Job(p, min(256, env.slots.max_len - 32), s) for p, s in zip(runners, sinks)]
  new = Sink()
  sched.start()
  try:
    sched.submit(jobs)
    for s in sinks:
      s.first.wait()
    t0 = time.perf_counter()
    sched.submit([Job(prompt, 2, new)])
    new.first.wait()
    t1 = new.times[0]
    if not warm_up:
      sched.cancel(jobs)
    for s in sinks + [new]:
      s.done.wait()
  finally:
    sched.stop()
  gaps = []
  for s in sinks:
    before, after = [t for t in s.times if t <= t0][-1:], [t for t in s.times if t > t1][:1]
    ts = before + [t for t in s.times if t0 < t <= t1] + after
    gaps += [b - a for a, b in zip(ts, ts[1:])]
  return max(gaps, default=float("nan")), t1 - t0


def prefix(env, minimum: int, prompt: list[int], more: list[int]) -> tuple[float, list[int]]:
  """The next turn's time to first token (seconds) and its tokens."""
  from MaxText.serve.scheduler import Job, Scheduler
  sched = Scheduler(env.model, env.slots, 16, prefill_chunk=128, prefix_min=minimum)
  first, turn = Sink(), Sink()
  sched.start()
  try:
    sched.submit([Job(prompt, 8, first)])
    first.done.wait()
    t0 = time.perf_counter()
    sched.submit([Job(prompt + first.ids[:-1] + more, 4, turn)])
    turn.done.wait()
  finally:
    sched.stop()
  return turn.times[0] - t0, turn.ids


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--family", default="gemma4", choices=["gemma4", "qwen3_next", "qwen3"])
  ap.add_argument("--prompt", type=int, default=1024)
  ap.add_argument("--rounds", type=int, default=2)
  ap.add_argument("--set", nargs="*", default=[], help="config overrides, key=value")
  args = ap.parse_args()

  import jax
  import numpy as np
  from MaxText.config.load import load_config
  from MaxText.decoding.engine import Engine
  from MaxText.decoding.slots import Slots
  from MaxText.models.model_config import ModelConfig
  from MaxText.models.registry import init_params
  from MaxText.sharding.mesh import create_mesh
  from MaxText.sharding.rules import parse_rules

  preset = args.family.replace("_", "-") + "-tiny"
  cfg = load_config([os.path.join(ROOT, "configs", "base.yml"), f"model_name={preset}",
                     "ici_fsdp_parallelism=1", "dtype=float32", *args.set])
  mcfg = ModelConfig.from_config(cfg)
  mesh = create_mesh(cfg, jax.devices()[:1])
  eng = Engine(mcfg, mesh, parse_rules(cfg.logical_axis_rules, cfg.mesh_axes), batch_size=4)
  params = eng.place(init_params(mcfg, 0))
  max_len = 1 << (args.prompt + 600).bit_length()
  slots = Slots(eng, 4, max_len, chunk=8)
  env = SimpleNamespace(model=SimpleNamespace(params=params, engine=eng, eos_ids=[]), slots=slots)
  rng = np.random.default_rng(0)
  draw = lambda n: rng.integers(0, mcfg.vocab_size, n).tolist()
  print(f"{args.family}: {sum(x.size for x in jax.tree.leaves(params)) / 1e6:.2f}M parameters, "
        f"prompt {args.prompt}, slots of {max_len}, load {os.getloadavg()[0]:.1f}", flush=True)
  rows = {"stall whole": [], "stall pieces": [], "ttft whole": [], "ttft pieces": [],
          "turn off": [], "turn on": []}
  for r in range(args.rounds + 1):           # round 0: the warm-up (compiles)
    prompt, runners, more = draw(args.prompt), [draw(16), draw(16)], draw(16)
    for name, chunk in (("whole", 0), ("pieces", 128)):
      gap, ttft = stall(env, chunk, prompt, runners, warm_up=not r)
      if r:
        rows[f"stall {name}"].append(gap)
        rows[f"ttft {name}"].append(ttft)
    got = {}
    for name, minimum in (("off", 0), ("on", 16)):
      ttft, got[name] = prefix(env, minimum, prompt, more)
      if r:
        rows[f"turn {name}"].append(ttft)
    assert got["off"] == got["on"], got
    print(f"round {r}{' (warm-up)' if not r else ''} done, load {os.getloadavg()[0]:.1f}",
          flush=True)
  print("| figure (s), rounds | " + " | ".join(rows) + " |")
  print("|---|" + "---|" * len(rows))
  print(f"| {args.family} | " + " | ".join(" / ".join(f"{x:.2f}" for x in v)
                                           for v in rows.values()) + " |")


if __name__ == "__main__":
  main()
