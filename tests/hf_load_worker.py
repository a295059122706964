"""One process of tests/test_hf_sharded_families.py (run by MaxText.launch.local): each Hugging
Face folder named on the command line read onto 2 processes x 4 devices (fsdp=4, tensor=2) by
hf_sharded.load_sharded, each process its own slices; every parameter then gathered whole and
written by process 0 to OUT/<name>.npz. Each process writes what it read (or the error that
stopped the load) to OUT/<name>.<process>.json. The item named `refit`: the folder's parameters
placed over fsdp=8 (read by each process's slices) and streamed with refit.stream (layout
"checkpoint"); each process writes every tensor it received to OUT/refit.process_<i>.npz.

  hf_load_worker.py OUT NAME=FOLDER [NAME=FOLDER ...] [refit=FOLDER]
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(os.environ["JAX_COORDINATOR_ADDRESS"],
                           int(os.environ["JAX_NUM_PROCESSES"]), int(os.environ["JAX_PROCESS_ID"]))

from jax.sharding import PartitionSpec  # noqa: E402

from MaxText import refit  # noqa: E402
from MaxText.config.load import replace  # noqa: E402
from MaxText.inference import ShardedHF, sharded_hf_config  # noqa: E402
from MaxText.models.model_config import ModelConfig  # noqa: E402
from MaxText.models.registry import get_hf_map, make_model_def  # noqa: E402
from MaxText.resolve import hf_sharded  # noqa: E402
from MaxText.sharding.mesh import create_mesh  # noqa: E402
from MaxText.sharding.rules import parse_rules, tree_shardings  # noqa: E402


def load(folder: str):
  found = sharded_hf_config(folder, [])
  assert found is not None and isinstance(found[1], ShardedHF)
  cfg = replace(found[0], ici_data_parallelism=1, ici_fsdp_parallelism=4,
                ici_tensor_parallelism=2)
  mcfg = ModelConfig.from_config(cfg)
  md = make_model_def(mcfg)
  sh = tree_shardings(md.logical_axes, md.abstract_params, create_mesh(cfg, jax.devices()),
                      parse_rules(cfg.logical_axis_rules, cfg.mesh_axes))
  abstract = jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h),
                          md.abstract_params, sh)
  return hf_sharded.load_sharded(folder, get_hf_map(cfg.hf_model_type), mcfg, abstract)


def stream(folder: str, out: str) -> None:
  """refit.stream of the folder's parameters over fsdp=8: no process holds any whole matrix."""
  found = sharded_hf_config(folder, [])
  assert found is not None and isinstance(found[1], ShardedHF)
  cfg, source = found
  cfg = replace(cfg, ici_data_parallelism=1, ici_fsdp_parallelism=8, ici_tensor_parallelism=1)
  mcfg = ModelConfig.from_config(cfg)
  md = make_model_def(mcfg)
  sh = tree_shardings(md.logical_axes, md.abstract_params, create_mesh(cfg, jax.devices()),
                      parse_rules(cfg.logical_axis_rules, cfg.mesh_axes))
  params = source.place(mcfg, jax.tree.map(
      lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h), md.abstract_params, sh))
  assert not all(a.is_fully_addressable for a in jax.tree.leaves(params))
  got = dict(refit.stream(params, cfg, layout="checkpoint"))
  np.savez(os.path.join(out, f"refit.process_{jax.process_index()}.npz"), **got)


def main(out: str, *named: str) -> None:
  me = jax.process_index()
  for item in named:
    name, folder = item.split("=", 1)
    if name == "refit":
      stream(folder, out)
      continue
    try:
      params, stats = load(folder)
    except hf_sharded.HFFolderError as e:
      with open(os.path.join(out, f"{name}.{me}.json"), "w") as f:
        json.dump({"error": str(e)}, f)
      continue
    leaves = jax.tree_util.tree_leaves_with_path(params)
    assert any(not a.is_fully_addressable for _, a in leaves)
    # every leaf gathered whole by one program (process_allgather compiles one per leaf)
    replicated = jax.tree.map(lambda a: a.sharding.update(spec=PartitionSpec()), params)
    gathered = jax.jit(lambda tree: tree, out_shardings=replicated)(params)
    whole = {jax.tree_util.keystr(p): np.asarray(a.addressable_data(0))
             for p, a in jax.tree_util.tree_leaves_with_path(gathered)}
    with open(os.path.join(out, f"{name}.{me}.json"), "w") as f:
      json.dump({"reads": stats.reads, "bytes": stats.bytes, "ranges": stats.ranges}, f)
    if me == 0:
      np.savez(os.path.join(out, f"{name}.npz"), **whole)


if __name__ == "__main__":
  main(*sys.argv[1:])
