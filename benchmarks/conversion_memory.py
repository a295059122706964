"""Peak RSS of the converters on a model of >= 1 GB of weights (random values, built locally).

  .venv/bin/python benchmarks/conversion_memory.py [--layers 6] [--work DIR]

Builds a Qwen3-shaped Hugging Face folder (hidden 2048, GQA 16/8 × 128, mlp 5504, vocab 32000,
fp32, 2 GB shards) without torch, then runs to_maxtext and to_huggingface each in a fresh process
(export shards of `--shard-gb`, since safetensors writes a whole shard at once)
and reports its peak RSS against the size of one copy of the weights, and the RSS of a process that
only imports the same modules (the fixed cost of Python + JAX).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def build(folder: str, layers: int) -> int:
  import numpy as np
  from MaxText.checkpoint_conversion.hf_io import write_hf_folder
  from MaxText.checkpoint_conversion.to_maxtext import config_for_hf
  from MaxText.models.model_config import ModelConfig
  from MaxText.models.registry import get_hf_map, make_model_def
  hf_map = get_hf_map("qwen3")
  hf_config = {"model_type": "qwen3", "vocab_size": 32000, "hidden_size": 2048,
               "intermediate_size": 5504, "num_hidden_layers": layers, "num_attention_heads": 16,
               "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 4096,
               "rope_theta": 1e6, "tie_word_embeddings": False}
  mcfg = ModelConfig.from_config(config_for_hf(hf_config, []))
  rng = np.random.default_rng(0)
  import jax
  params = jax.tree.map(lambda s: rng.standard_normal(s.shape, dtype=np.float32) * 0.02,
                        make_model_def(mcfg).abstract_params)
  tensors = hf_map.params_to_hf(params, mcfg)
  nbytes = sum(t.nbytes for t in tensors.values())
  write_hf_folder(folder, tensors, hf_map.config_to_hf(mcfg), max_shard_bytes=2 * 2**30)
  return nbytes


def peak_rss(cmd: list[str]) -> float:
  proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  _, status, usage = os.wait4(proc.pid, 0)
  if os.waitstatus_to_exitcode(status) != 0:
    raise SystemExit(f"failed: {' '.join(cmd)}")
  return usage.ru_maxrss * 1024


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--layers", type=int, default=6)
  ap.add_argument("--work", default="")
  ap.add_argument("--shard-gb", type=float, default=0.5, help="to_huggingface max_shard_gb")
  ap.add_argument("--build-only", default="", help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.build_only:  # in a child, so this process stays small: ru_maxrss survives fork+exec
    print(build(args.build_only, args.layers))
    return 0
  work = args.work or tempfile.mkdtemp(prefix="conv_mem_")
  hf, ckpt, out = (os.path.join(work, n) for n in ("hf", "ckpt", "export"))
  py = sys.executable
  size = int(subprocess.run([py, __file__, "--layers", str(args.layers), "--build-only", hf],
                            check=True, capture_output=True, text=True).stdout.split()[-1])
  base = peak_rss([py, "-c", "import MaxText.checkpoint_conversion.to_maxtext, "
                   "MaxText.checkpoint_conversion.to_huggingface"])
  to_mt = peak_rss([py, "-m", "MaxText.checkpoint_conversion.to_maxtext", f"hf_path={hf}",
                    f"output_path={ckpt}"])
  to_hf = peak_rss([py, "-m", "MaxText.checkpoint_conversion.to_huggingface",
                    f"load_parameters_path={ckpt}", f"output_path={out}",
                    f"max_shard_gb={args.shard_gb}"])
  g = 2**30
  print(f"\nweights: {size / g:.2f} GiB (one copy)   imports only: {base / g:.2f} GiB")
  print("| converter | peak RSS GiB | × one copy | (peak − imports) × one copy |")
  print("|---|---|---|---|")
  for name, rss in (("to_maxtext", to_mt), ("to_huggingface", to_hf)):
    print(f"| {name} | {rss / g:.2f} | {rss / size:.2f} | {(rss - base) / size:.2f} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
