"""MoE layer step time (forward + backward) at expert parallelism 1/2/4 versus a dense gated MLP of
equal active parameters (mlp_dim = k x expert width), on whatever devices JAX sees.

  .venv/bin/python benchmarks/moe.py [--devices 4] [--tokens 8192] [--dim 256] [--experts 8]
                                     [--top-k 2] [--expert-dim 256] [--repeats 10]

On CPU it fakes `--devices` host devices (XLA_FLAGS) and the exchange is the padded all-to-all; on
GPU/TPU the real `jax.lax.ragged_all_to_all` (moe_dispatch=auto). The mesh is (data = devices/EP,
expert = EP); tokens are split over both axes, the experts over `expert`. Prints one Markdown table
and the compute dtype: float32 (the config's dtype=auto as `load_config` gives it to a tool, not a
training run's bfloat16; `--dtype bfloat16` for bf16, both layers).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--devices", type=int, default=4)
  ap.add_argument("--tokens", type=int, default=8192)
  ap.add_argument("--dim", type=int, default=256)
  ap.add_argument("--experts", type=int, default=8)
  ap.add_argument("--top-k", type=int, default=2)
  ap.add_argument("--expert-dim", type=int, default=256)
  ap.add_argument("--repeats", type=int, default=10)
  ap.add_argument("--dtype", default="", help="compute dtype (default: the config's, float32)")
  args = ap.parse_args()
  os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.devices}")

  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx
  from jax.sharding import NamedSharding

  from MaxText.config.load import load_config
  from MaxText.layers.mlp import GatedMLP
  from MaxText.layers.moe import RoutedMLP
  from MaxText.models.model_config import ModelConfig
  from MaxText.sharding.mesh import create_mesh
  from MaxText.sharding.rules import logical_to_spec, parse_rules, use_rules

  devices = jax.devices()[: args.devices]
  n = len(devices)
  base = os.path.join(ROOT, "configs", "base.yml")
  B, S, D = max(1, args.tokens // 512), 512, args.dim
  x = np.random.default_rng(0).normal(size=(B, S, D)).astype(np.float32)
  mask = np.ones((B, S), bool)

  def setup(ep):
    cfg = load_config([base, f"emb_dim={D}", f"num_experts={args.experts}",
                       f"num_experts_per_tok={args.top_k}", f"moe_mlp_dim={args.expert_dim}",
                       f"ici_data_parallelism={n // ep}", "ici_fsdp_parallelism=1",
                       f"ici_expert_parallelism={ep}", *([f"dtype={args.dtype}"] if args.dtype
                                                         else [])])
    return cfg, create_mesh(cfg, devices), parse_rules(cfg.logical_axis_rules, cfg.mesh_axes)

  def timed(make_layer, ep, moe):
    cfg, mesh, rules = setup(ep)
    with nnx.use_eager_sharding(False):
      graphdef, params = nnx.split(make_layer(cfg))
    spec = logical_to_spec(("activation_batch", "activation_length", None), x.shape, rules, mesh)
    xs = jax.device_put(x, NamedSharding(mesh, spec))

    def loss(p, xx):
      with use_rules(mesh, rules):
        layer = nnx.merge(graphdef, p)
        y = layer(xx, mask)[0] if moe else layer(xx)
        return jnp.mean(jnp.square(y))

    step = jax.jit(jax.value_and_grad(loss))
    jax.block_until_ready(step(params, xs))
    t0 = time.perf_counter()
    for _ in range(args.repeats):
      jax.block_until_ready(step(params, xs))
    return (time.perf_counter() - t0) / args.repeats

  rows = []
  for ep in (1, 2, 4):
    if ep > n or args.experts % ep or n % ep or B % n:
      continue
    moe = lambda cfg: RoutedMLP(ModelConfig.from_config(cfg), rngs=nnx.Rngs(params=0))
    rows.append((f"MoE, EP {ep}", timed(moe, ep, True)))
  width = args.top_k * args.expert_dim
  dense = lambda cfg: GatedMLP(D, width, "silu", rngs=nnx.Rngs(params=0),
                               dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.float32)
  rows.append((f"dense MLP, width {width} (equal active params)", timed(dense, 1, False)))
  print(f"\n{len(devices)} {devices[0].platform} devices; {args.tokens} tokens, D={D}, "
        f"{args.experts} experts of width {args.expert_dim}, top-{args.top_k}; compute "
        f"{setup(1)[0].dtype}, weights float32; fwd+bwd, mean of {args.repeats}")
  print("| layer | step ms | tokens/s |")
  print("|---|---|---|")
  for name, t in rows:
    print(f"| {name} | {t * 1e3:.1f} | {args.tokens / t:,.0f} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
