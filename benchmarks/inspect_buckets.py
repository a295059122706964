"""Prompts of many lengths through `MaxText.inspect`'s forward: the length / batch buckets
(`forward(..., buckets=True)`, the default) against one program per exact shape
(`buckets=False`), side by side in one process on one randomly initialised model: programs
compiled and wall time for N prompts of lengths spread over [5, 500], and the worst difference
of the logits between the two (the padding is masked; only the summation order differs).

  .venv/bin/python benchmarks/inspect_buckets.py [--model qwen3-tiny] [--prompts 50]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--model", default="qwen3-tiny")
  ap.add_argument("--prompts", type=int, default=50)
  args = ap.parse_args()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

  import jax
  import numpy as np

  from MaxText import inference
  from MaxText.config.load import load_config
  from MaxText.inspect import BASE_YML, Inspector
  from MaxText.models.model_config import ModelConfig
  from MaxText.models.registry import init_params

  cfg = load_config([BASE_YML, f"model_name={args.model}", "dtype=float32",
                     "max_position_embeddings=1024"])
  params = jax.device_get(init_params(ModelConfig.from_config(cfg), 0))
  m = Inspector(inference.load(cfg, devices=jax.devices()[:1], params=params))
  rng = np.random.default_rng(0)
  lengths = np.linspace(5, 500, args.prompts).astype(int)
  prompts = [rng.integers(0, m.mcfg.vocab_size, n).tolist() for n in lengths]
  print(f"{args.model}: {m.num_layers} layers, D = {m.mcfg.emb_dim}, {args.prompts} prompts of "
        f"{lengths.min()}..{lengths.max()} tokens, fp32, {jax.devices()[0].platform}")
  print("| forward | programs compiled | wall s |")
  print("|---|---|---|")
  logits = {}
  for name, buckets in (("length buckets", True), ("exact shapes", False)):
    before, start = m.compiled_programs(), time.perf_counter()
    logits[name] = [m.forward(p, capture=["logits"], buckets=buckets).logits for p in prompts]
    print(f"| {name} | {m.compiled_programs() - before} | {time.perf_counter() - start:.1f} |",
          flush=True)
  worst = max(float(np.abs(a - b).max() / max(1.0, np.abs(b).max()))
              for a, b in zip(logits["length buckets"], logits["exact shapes"]))
  print(f"worst |bucketed - exact| / max|logits| = {worst:.1e}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
