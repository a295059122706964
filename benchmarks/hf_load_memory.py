"""hf_path= read onto the mesh by 2 processes vs to_maxtext: bytes read and peak RSS per process.

  .venv/bin/python benchmarks/hf_load_memory.py [--layers 1] [--work DIR]

Builds the Qwen3-shaped folder of benchmarks/conversion_memory.py (hidden 2048, vocab 32000,
fp32, random values; `--layers` decoder layers), then in fresh processes:
  - to_maxtext (one host converts the whole model; peak RSS from wait4);
  - the sharded load (MaxText/resolve/hf_sharded.py) as 2 processes x 4 fake CPU devices
    (MaxText.launch.local), parameters over fsdp=8: each process reports the bytes its ranged
    reads fetched and its peak RSS, before and after the load;
  - the same load as 1 process x 8 devices (every slice on one host).
On CPU the devices' buffers are host memory, so a process's RSS includes the shards it holds: the
load's increase should be about its shard plus one slice, to_maxtext's one copy of the model.
"""
from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
G = 2**30


def load_here(hf: str) -> None:
  """One process of the sharded load: prints its bytes read and RSS before / after."""
  import jax
  if "JAX_COORDINATOR_ADDRESS" in os.environ:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(os.environ["JAX_COORDINATOR_ADDRESS"],
                               int(os.environ["JAX_NUM_PROCESSES"]),
                               int(os.environ["JAX_PROCESS_ID"]))
  from MaxText.config.load import replace
  from MaxText.inference import sharded_hf_config
  from MaxText.models.model_config import ModelConfig
  from MaxText.models.registry import get_hf_map, make_model_def
  from MaxText.resolve import hf_sharded
  from MaxText.sharding.mesh import create_mesh
  from MaxText.sharding.rules import parse_rules, tree_shardings
  found = sharded_hf_config(hf, [])
  assert found is not None
  cfg = replace(found[0], ici_data_parallelism=1, ici_fsdp_parallelism=8,
                ici_tensor_parallelism=1)
  mcfg = ModelConfig.from_config(cfg)
  md = make_model_def(mcfg)
  sh = tree_shardings(md.logical_axes, md.abstract_params, create_mesh(cfg, jax.devices()),
                      parse_rules(cfg.logical_axis_rules, cfg.mesh_axes))
  abstract = jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h),
                          md.abstract_params, sh)
  before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  params, stats = hf_sharded.load_sharded(hf, get_hf_map(cfg.hf_model_type), mcfg, abstract)
  jax.block_until_ready(params)
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  held = sum(s.data.nbytes for a in jax.tree.leaves(params) for s in a.addressable_shards)
  print(f"RESULT process {jax.process_index()}: read {stats.bytes} bytes in {stats.reads} reads "
        f"({stats.ranges} ranges); "
        f"shards held {held}; peak RSS before load {before}, after {peak}", flush=True)


def main() -> int:
  from conversion_memory import peak_rss
  ap = argparse.ArgumentParser()
  ap.add_argument("--layers", type=int, default=1)
  ap.add_argument("--work", default="")
  ap.add_argument("--load", default="", help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.load:
    load_here(args.load)
    return 0
  work = args.work or tempfile.mkdtemp(prefix="hf_load_mem_")
  hf, ckpt = os.path.join(work, "hf"), os.path.join(work, "ckpt")
  py = sys.executable
  if not os.path.isdir(hf):
    subprocess.run([py, os.path.join(ROOT, "benchmarks", "conversion_memory.py"), "--layers",
                    str(args.layers), "--build-only", hf], check=True, capture_output=True)
  size = os.path.getsize(os.path.join(hf, "model.safetensors"))
  to_mt = peak_rss([py, "-m", "MaxText.checkpoint_conversion.to_maxtext", f"hf_path={hf}",
                    f"output_path={ckpt}"])
  rows = []
  for processes, devices in ((2, 4), (1, 8)):
    out = subprocess.run([py, "-m", "MaxText.launch.local", f"processes={processes}",
                          f"devices_per_process={devices}", "--", __file__, "--load", hf],
                         cwd=ROOT, capture_output=True, text=True, check=False)
    found = re.findall(r"RESULT process (\d+): read (\d+) bytes in (\d+) reads \((\d+) ranges\); "
                       r"shards held "
                       r"(\d+); peak RSS before load (\d+), after (\d+)", out.stdout + out.stderr)
    if out.returncode or len(found) != processes:
      raise SystemExit(out.stdout[-3000:] + out.stderr[-3000:])
    rows += [(f"hf_path= load, {processes} x {devices} devices, process {p}", *map(int, rest))
             for p, *rest in found]
  print(f"\nfolder: {size / G:.2f} GiB (model.safetensors, fp32)")
  print("| what | bytes read GiB | ranged reads (ranges asked) | shards held GiB | peak RSS GiB "
        "(before the load) | peak − before, × one copy |")
  print("|---|---|---|---|---|---|")
  for name, read, reads, ranges, held, before, peak in rows:
    print(f"| {name} | {read / G:.3f} | {reads} ({ranges}) | {held / G:.3f} | {peak / G:.2f} "
          f"({before / G:.2f}) | {(peak - before) / size:.2f} |")
  print(f"| to_maxtext (1 process) | {size / G:.3f} | – | – | {to_mt / G:.2f} | – |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
