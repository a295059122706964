"""What one inspected forward holds: Gemma 4 E2B (35 layers, 8 heads) on S tokens, capturing the
attention of every layer against one layer (and one head), from XLA's own count of the compiled
program's buffers on one device (arguments, outputs, temporaries). Parameters are abstract: nothing
is loaded or run, so it needs no more memory than compiling does.

  .venv/bin/python benchmarks/inspect_memory.py [--model gemma4] [--seq 2048] [--layer 3] [--devices 1]
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
GiB = 2**30


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--model", default="gemma4")
  ap.add_argument("--seq", type=int, default=2048)
  ap.add_argument("--layer", type=int, default=3)
  ap.add_argument("--devices", type=int, default=1)
  args = ap.parse_args()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

  import jax

  from MaxText.config.load import load_config
  from MaxText.decoding.engine import Engine
  from MaxText.inference import InferenceModel
  from MaxText.inspect import BASE_YML, Inspector
  from MaxText.models.model_config import ModelConfig
  from MaxText.sharding.mesh import create_mesh
  from MaxText.sharding.rules import parse_rules

  devices = jax.devices()[:args.devices]
  cfg = load_config([BASE_YML, f"model_name={args.model}", f"max_target_length={args.seq}"])
  engine = Engine(ModelConfig.from_config(cfg), create_mesh(cfg, devices),
                  parse_rules(cfg.logical_axis_rules, cfg.mesh_axes))
  params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        engine.model_def.abstract_params, engine.param_shardings)
  m = Inspector(InferenceModel(cfg, engine, params, None, "none"))
  L, H, S = m.num_layers, m.mcfg.num_query_heads, args.seq
  print(f"{args.model}: {L} layers, {H} heads, S = {S}, {args.devices} device(s), "
        f"{m.mcfg.dtype}; one layer's attention [H, S, S] fp32 = {H * S * S * 4 / GiB:.3f} GiB")
  print("| capture | outputs GiB | temporaries GiB | arguments GiB |")
  print("|---|---|---|---|")
  runs = [("logits only", ["logits"], None, None),
          ("attentions, every layer", ["attentions"], None, None),
          (f"attentions, layer {args.layer}", ["attentions"], [args.layer], None),
          (f"attentions, layer {args.layer} head 0", ["attentions"], [args.layer], [0])]
  for name, capture, layers, heads in runs:
    cost = m.program_memory(S, capture, layers=layers, heads=heads)
    print(f"| {name} | {cost['output'] / GiB:.3f} | {cost['temp'] / GiB:.3f} | "
          f"{cost['argument'] / GiB:.3f} |", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
