"""Peak memory of the train step with a 262,144-token vocabulary (Gemma 4's) at S = 4096, with and
without the chunked cross-entropy (`loss_chunk_length`), from XLA's own count of the compiled
step's buffers on one device (arguments + temporaries + outputs not aliased to a donated input;
nothing is run, so it needs no more memory than compiling does).

Model: a tiny dense decoder (D 256, 4 layers, 4 heads of 64, MLP 1024) with the big vocabulary,
fp32, batch 1, untied head. The logits' part of the peak is measured against a very small chunk
(the step is otherwise identical): logits(c) = peak(c) - peak(c_min) + 3 x c_min x V x 4 bytes.

  .venv/bin/python benchmarks/loss_memory.py [--chunks 0,1024,512,64] [--vocab 262144] [--seq 4096]
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
  ap.add_argument("--chunks", default="0,1024,512,64", help="loss_chunk_length values; the last "
                  "(smallest) is the reference for the logits' share")
  ap.add_argument("--vocab", type=int, default=262144)
  ap.add_argument("--seq", type=int, default=4096)
  ap.add_argument("--dtype", default="float32")
  args = ap.parse_args()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

  import jax

  from MaxText.config.load import load_config
  from MaxText.train import memory
  from MaxText.train.loop import Trainer

  keys = ["emb_dim=256", "num_decoder_layers=4", "num_query_heads=4", "num_kv_heads=4",
          "head_dim=64", "mlp_dim=1024", f"vocab_size={args.vocab}", f"max_target_length={args.seq}",
          f"max_position_embeddings={args.seq}", "per_device_batch_size=1", "ici_fsdp_parallelism=1",
          f"dtype={args.dtype}", "dataset_type=synthetic", "jax_cache_dir="]
  chunks = [int(c) for c in args.chunks.split(",")]
  rows = []
  for chunk in chunks:
    cfg = load_config([os.path.join(ROOT, "configs/base.yml"), *keys, f"loss_chunk_length={chunk}"])
    trainer = Trainer(cfg, jax.devices()[:1])
    compiled = trainer.compile_step()
    ma = compiled.memory_analysis()
    est = memory.activation_bytes(trainer.mcfg, rows=1, seq=args.seq, loss_chunk=chunk)
    rows.append((chunk, memory.compiled_step_bytes(compiled), ma.temp_size_in_bytes, est))
  ref_chunk, ref_peak = rows[-1][0], rows[-1][1]
  ref_logits = 3 * ref_chunk * args.vocab * 4
  whole = None
  print(f"\nV = {args.vocab:,}, S = {args.seq}, batch 1, {args.dtype}; one [1, S, V] fp32 logits "
        f"array = {args.seq * args.vocab * 4 / GiB:.2f} GiB")
  print("| loss_chunk_length | step peak GiB (XLA) | temporaries GiB | logits' share GiB | "
        "vs whole | pre-flight activation estimate GiB |")
  print("|---|---|---|---|---|---|")
  for chunk, peak, temp, est in rows:
    share = peak - ref_peak + ref_logits
    whole = share if whole is None else whole
    print(f"| {chunk or 'whole sequence'} | {peak / GiB:.2f} | {temp / GiB:.2f} | {share / GiB:.2f} | "
          f"{whole / share:.1f}x smaller | {est / GiB:.2f} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
