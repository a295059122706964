"""What the vision and audio towers add to a Gemma 4 training step: parameters, model FLOPs per
step (what MFU divides by) and the memory pre-flight's figures per device, from the family's own
counts (`Family.flops`, `Family.activation_bytes`, the abstract parameters) — nothing is run.

  .venv/bin/python benchmarks/multimodal_budget.py [--model gemma4-e2b] [--seq 4096] [--rows 1]
      [--images 1,4] [--audio-seconds 30]

Rows: the text model (`--model`), then `<model>-mm` (both towers' parameters) with
`images_per_sequence` of each `--images`, the towers frozen (the default, forward only) and
trained, and with `--audio-seconds` of audio per sequence (`audio_seconds_per_sequence`). State = fp32 parameters, their gradients
and two AdamW moments (16 bytes a parameter), all on one device; activations for `--rows`
sequences of `--seq` tokens per device (remat_policy=full, bf16 compute, flash attention).
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import jax

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from MaxText.config.load import BASE_YML, load_config  # noqa: E402
from MaxText.metrics.flops import training_flops_per_step  # noqa: E402
from MaxText.models.model_config import ModelConfig  # noqa: E402
from MaxText.models.registry import get_family, make_model_def  # noqa: E402
from MaxText.train import memory  # noqa: E402

GiB = 2 ** 30


def row(name: str, extra: list[str], seq: int, rows: int) -> dict:
  cfg = load_config([BASE_YML, f"model_name={name}", "dtype=bfloat16", "remat_policy=full",
                     "attention=flash", *extra])
  mcfg = ModelConfig.from_config(cfg)
  family = get_family(mcfg.decoder_block)
  params = make_model_def(mcfg).abstract_params
  count = lambda tree: sum(math.prod(a.shape) for a in jax.tree.leaves(tree))
  vision = count(params.get("vision", {})) + count(params.get("embed_vision", {}))
  audio = count(params.get("audio", {})) + count(params.get("embed_audio", {}))
  total = count(params)
  flops = training_flops_per_step(family.flops(mcfg, seq, True), seq_len=seq, global_batch=rows)
  acts = (memory.activation_bytes(mcfg, rows=rows, seq=seq)
          + family.activation_bytes(mcfg, rows, seq))
  return {"config": " ".join([name, *extra]), "params_b": total / 1e9, "vision_m": vision / 1e6,
          "audio_m": audio / 1e6,
          "tflop": flops["total"] / 1e12, "towers_tflop": flops["towers"] / 1e12,
          "state_gib": 16 * total / GiB, "acts_gib": acts / GiB}


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--model", default="gemma4-e2b")
  ap.add_argument("--seq", type=int, default=4096)
  ap.add_argument("--rows", type=int, default=1)
  ap.add_argument("--images", default="1,4")
  ap.add_argument("--audio-seconds", type=float, default=30.0)
  args = ap.parse_args()
  rows = [row(args.model, [], args.seq, args.rows)]
  for n in args.images.split(","):
    for frozen in ("true", "false"):
      rows.append(row(args.model + "-mm", [f"images_per_sequence={n}",
                                           f"freeze_vision_encoder={frozen}"],
                      args.seq, args.rows))
  for frozen in ("true", "false"):
    rows.append(row(args.model + "-mm", [f"audio_seconds_per_sequence={args.audio_seconds:g}",
                                         f"freeze_audio_encoder={frozen}"], args.seq, args.rows))
  print(f"| config (seq {args.seq}, {args.rows} sequence(s) per device) | params (B) | vision "
        f"tower + embedder (M) | audio tower + embedder (M) | TFLOP per step | of which towers | "
        f"state GiB | activations GiB |")
  print("|---|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| `{r['config']}` | {r['params_b']:.3f} | {r['vision_m']:.1f} | {r['audio_m']:.1f} | "
          f"{r['tflop']:.2f} | {r['towers_tflop']:.3f} | {r['state_gib']:.2f} | "
          f"{r['acts_gib']:.2f} |")


if __name__ == "__main__":
  main()
