"""Decoding speed and cache memory: our engine (MaxText/decoding/) against transformers' generate
on the same weights and prompts, greedy, side by side in one run; plus the Gemma 4 E2B cache at
32k tokens with ring buffers vs full-length caches (computed, nothing allocated).

  .venv/bin/python benchmarks/decode.py [--batches 1,8,32] [--prompt 128] [--new 64]
                                        [--layers 12] [--dim 768] [--vocab 32768]

The model is Qwen3-shaped (q/k norm, GQA 12/4, head dim 64, SwiGLU, tied head): ~101M parameters
at the defaults, random weights (transformers' init, seed 0), fp32 on both sides, our copy
converted with the qwen3 name map. Each side runs `generate` with max_new_tokens = 1 and = --new
on the same prompts (every row --prompt random tokens) after one untimed warm-up (our compiles,
torch's first-call costs): prefill tokens/s = rows x prompt / t(1); decode tokens/s = rows x
(new - 1) / (t(new) - t(1)). Cache memory: ours is the engine's cache (its bucketed length),
transformers' the DynamicCache it returned. Greedy tokens are compared row by row (a difference
is a near-tie: the first differing step's top-2 logit gap is printed). On a GPU the same command
runs our side on the GPU (cache in bfloat16 by default) and torch on the CPU.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def hf_model(args):
  import torch
  import transformers
  torch.manual_seed(0)
  config = transformers.Qwen3Config(
      vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=args.mlp,
      num_hidden_layers=args.layers, num_attention_heads=args.dim // 64,
      num_key_value_heads=4 if (args.dim // 64) % 4 == 0 else args.dim // 64,
      head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1e6,
      tie_word_embeddings=True, attn_implementation="sdpa")
  model = transformers.Qwen3ForCausalLM(config).float().eval()
  model.generation_config.eos_token_id = None
  return model


def timed(fn, repeats: int = 1) -> tuple[float, object]:
  best, out = float("inf"), None
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = fn()
    best = min(best, time.perf_counter() - t0)
  return best, out


def gemma4_e2b_cache_table(context: int) -> str:
  """Gemma 4 E2B's decoding cache for one sequence of `context` tokens, bf16, computed from its
  config: our cache (sliding layers a ring of their window, the KV-shared tail nothing) against
  full-length caches for the sliding layers (what MaxText and Tunix keep) and against a cache per
  layer (no sharing)."""
  import dataclasses

  import jax.numpy as jnp

  from MaxText.config.load import load_config
  from MaxText.decoding import cache as cache_lib
  from MaxText.layers.kv_cache import CacheGroup
  from MaxText.models.gemma4.model import cache_kind, layer_kinds
  from MaxText.models.model_config import ModelConfig

  cfg = load_config([os.path.join(ROOT, "configs", "base.yml"), "model_name=gemma4-e2b"])
  mcfg = ModelConfig.from_config(cfg)
  dtype = jnp.bfloat16

  def nbytes(groups):
    total = 0
    for g in groups.values():
      for a in g.kind.arrays(1, context, dtype).values():
        n = g.layers
        for d in a.shape:
          n *= d
        total += n * jnp.dtype(a.dtype).itemsize
    return total

  ours = cache_lib.groups(mcfg)
  full_length = {n: dataclasses.replace(g, kind=dataclasses.replace(g.kind, window=0))
                 for n, g in ours.items()}
  kinds = layer_kinds(mcfg)
  per_layer = {t: CacheGroup(dataclasses.replace(cache_kind(mcfg, t), window=0),
                             sum(k.attention == t for k in kinds)) for t in ("sliding", "full")}
  rows = [("ours: sliding = ring of the window, KV-shared tail stores nothing", nbytes(ours)),
          ("full-length sliding caches, KV-shared tail stores nothing", nbytes(full_length)),
          ("full-length caches for every layer (no ring, no sharing)", nbytes(per_layer))]
  layers = {n: g.layers for n, g in ours.items()}
  out = [f"Gemma 4 E2B, one sequence of {context:,} tokens, bf16 K/V (groups {layers}, window "
         f"{mcfg.sliding_window}):", "", "| cache | MiB |", "|---|---|"]
  out += [f"| {name} | {b / 2**20:,.1f} |" for name, b in rows]
  return "\n".join(out)


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--batches", default="1,8,32")
  ap.add_argument("--prompt", type=int, default=128)
  ap.add_argument("--new", type=int, default=64)
  ap.add_argument("--layers", type=int, default=12)
  ap.add_argument("--dim", type=int, default=768)
  ap.add_argument("--mlp", type=int, default=2048)
  ap.add_argument("--vocab", type=int, default=32768)
  ap.add_argument("--context", type=int, default=32768, help="Gemma 4 E2B cache table length")
  args = ap.parse_args()

  import jax
  import numpy as np
  import torch

  from MaxText.config.load import load_config, replace
  from MaxText.decoding import cache as cache_lib
  from MaxText.decoding.engine import Engine
  from MaxText.models.model_config import ModelConfig
  from MaxText.models.llama import qwen3_hf_map as hf_map
  from MaxText.sharding.mesh import create_mesh
  from MaxText.sharding.rules import parse_rules

  torch.set_num_threads(os.cpu_count())
  model = hf_model(args)
  n_params = sum(p.numel() for p in model.parameters())
  cfg = load_config([os.path.join(ROOT, "configs", "base.yml"), "ici_fsdp_parallelism=1"])
  cfg = replace(cfg, **hf_map.config_from_hf(model.config.to_dict()), hf_model_type="qwen3")
  mcfg = ModelConfig.from_config(cfg)
  devices = jax.devices()[:1]
  mesh = create_mesh(cfg, devices)
  rules = parse_rules(cfg.logical_axis_rules, cfg.mesh_axes)
  state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
  uptime = os.popen("uptime").read().strip()
  print(f"# decode benchmark: {n_params / 1e6:.1f}M-parameter Qwen3-shaped model "
        f"({args.layers} layers, d {args.dim}, vocab {args.vocab}), prompt {args.prompt}, new "
        f"{args.new}, greedy, fp32; ours on {devices[0].platform}, transformers "
        f"{__import__('transformers').__version__} on CPU ({torch.get_num_threads()} threads)")
  print(f"# load before: {uptime}")
  rows = []
  for B in [int(b) for b in args.batches.split(",")]:
    engine = Engine(mcfg, mesh, rules, batch_size=B)
    params = engine.place(hf_map.hf_to_params(state, mcfg))
    prompts = np.random.default_rng(B).integers(0, args.vocab, (B, args.prompt))
    ids = prompts.tolist()
    ours = lambda n: engine.generate(params, ids, max_new_tokens=n)
    ours(args.new), ours(1)                          # compile (both use one cache length)
    t1, _ = timed(lambda: ours(1))
    tn, got = timed(lambda: ours(args.new))
    cache_mib = cache_lib.nbytes(cache_lib.specs(engine.mcfg, B, engine.cache_length(
        ids, args.new), engine.cache_dtype)) / 2**20
    rows.append(("ours", B, B * args.prompt / t1, B * (args.new - 1) / (tn - t1), cache_mib))

    inputs = torch.tensor(prompts)

    def theirs(n):
      with torch.no_grad():
        return model.generate(inputs, do_sample=False, pad_token_id=0, max_new_tokens=n,
                              return_dict_in_generate=True)
    theirs(2)                                         # warm-up
    h1, _ = timed(lambda: theirs(1))
    hn, out = timed(lambda: theirs(args.new))
    kv = out.past_key_values
    hf_mib = sum(t.numel() * t.element_size() for layer in kv.layers
                 for t in (layer.keys, layer.values)) / 2**20
    rows.append(("transformers", B, B * args.prompt / h1, B * (args.new - 1) / (hn - h1), hf_mib))
    want = out.sequences[:, args.prompt:].tolist()
    same = sum(g.output_ids == w for g, w in zip(got, want))
    print(f"batch {B}: greedy tokens equal in {same}/{B} rows")
    for g, w, p in zip(got, want, ids):
      if g.output_ids != w:
        j = next(i for i, (a, b) in enumerate(zip(g.output_ids, w)) if a != b)
        with torch.no_grad():
          top2 = torch.sort(model(torch.tensor([p + w[:j]])).logits[0, -1]).values[-2:]
        print(f"  first difference at new token {j}: top-2 logit gap {float(top2[1] - top2[0]):.1e}")
  print(f"# load after: {os.popen('uptime').read().strip()}")
  print()
  print("| engine | batch | prefill tok/s | decode tok/s | cache MiB |")
  print("|---|---|---|---|---|")
  for name, B, pre, dec, mib in rows:
    print(f"| {name} | {B} | {pre:,.0f} | {dec:,.1f} | {mib:,.1f} |")
  print()
  print("| batch | decode speed-up (ours / transformers) |")
  print("|---|---|")
  for (_, B, _, d_ours, _), (_, _, _, d_hf, _) in zip(rows[::2], rows[1::2]):
    print(f"| {B} | {d_ours / d_hf:.2f}x |")
  print()
  print(gemma4_e2b_cache_table(args.context))
  return 0


if __name__ == "__main__":
  sys.exit(main())
