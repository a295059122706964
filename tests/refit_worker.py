"""One process of tests/test_refit_multiprocess.py (run by MaxText.launch.local): a tiny Hugging
Face folder's parameters placed over fsdp=8 on the processes' devices (read by each process's
slices), streamed with refit.stream; writes every tensor and the largest one to OUT/process_<i>.npz."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(os.environ["JAX_COORDINATOR_ADDRESS"],
                           int(os.environ["JAX_NUM_PROCESSES"]), int(os.environ["JAX_PROCESS_ID"]))

from MaxText import refit  # noqa: E402
from MaxText.config.load import replace  # noqa: E402
from MaxText.inference import ShardedHF, sharded_hf_config  # noqa: E402
from MaxText.models.model_config import ModelConfig  # noqa: E402
from MaxText.models.registry import make_model_def  # noqa: E402
from MaxText.sharding.mesh import create_mesh  # noqa: E402
from MaxText.sharding.rules import parse_rules, tree_shardings  # noqa: E402


def main(hf_dir: str, out: str, layout: str) -> None:
  found = sharded_hf_config(hf_dir, [])
  assert found is not None
  cfg, source = found
  assert isinstance(source, ShardedHF)
  cfg = replace(cfg, ici_data_parallelism=1, ici_fsdp_parallelism=8, ici_tensor_parallelism=1)
  mcfg = ModelConfig.from_config(cfg)
  md = make_model_def(mcfg)
  sh = tree_shardings(md.logical_axes, md.abstract_params, create_mesh(cfg, jax.devices()),
                      parse_rules(cfg.logical_axis_rules, cfg.mesh_axes))
  params = source.place(mcfg, jax.tree.map(
      lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h), md.abstract_params, sh))
  assert not all(a.is_fully_addressable for a in jax.tree.leaves(params))
  got = {name: t for name, t in refit.stream(params, cfg, layout=layout)}
  np.savez(os.path.join(out, f"process_{jax.process_index()}.npz"), **got)


if __name__ == "__main__":
  main(*sys.argv[1:4])
