"""Diagnostic: per-parameter gradient of the first step, chip vs CPU, float32 at highest.

  JAX_PLATFORMS=tpu,cpu python3 benchmarks/tpu_diag_grads.py "model_name=gemma4-tiny" ...
"""
import json
import os
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def setup(variant: str):
  """The jitted `value_and_grad` of the first step's mean token loss of `variant` (its keys, one
  string, over tests/test_tpu.py's EXACT keys) at the run's precision, the init params (seed 0, on
  the CPU) and tests/test_tpu.py's fixed random batch."""
  import jax
  from MaxText.config.load import load_config
  from MaxText.losses.token_loss import token_loss_sums
  from MaxText.models.registry import init_params
  from MaxText.train.loop import Trainer
  from tests.test_tpu import EXACT, random_batch
  cfg = load_config([os.path.join(ROOT, "configs/base.yml"), "jax_cache_dir=",
                     f"base_output_directory={tempfile.mkdtemp()}", "run_name=diag",
                     *variant.split(), *EXACT], keep_auto=True)
  trainer = Trainer(cfg, jax.devices()[:1])
  md = trainer.model_def
  with jax.default_device(jax.devices("cpu")[0]):
    params = jax.device_get(init_params(trainer.mcfg, 0))
  batch = random_batch(trainer.global_batch, cfg.max_target_length, trainer.mcfg.vocab_size)

  def loss(p, b):
    nll, _, n, _ = token_loss_sums(md, p, b, z_loss_weight=0.0, chunk=0)
    return nll / n
  return jax.jit(md.at_precision(jax.value_and_grad(loss))), params, batch


def leaf_errors(got, want) -> dict:
  """Per-array relative error ||got - want|| / ||want|| (float64) of two gradient trees, keyed by
  the params' '/'-joined paths."""
  from flax import traverse_util
  fg, fw = ({"/".join(map(str, k)): v for k, v in traverse_util.flatten_dict(t).items()}
            for t in (got, want))
  errs = {}
  for k in fw:
    a, b = np.asarray(fg[k], np.float64), np.asarray(fw[k], np.float64)
    errs[k] = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
  return errs


def main(variants):
  import jax
  cpu = jax.devices("cpu")[0]
  for variant in variants:
    fn, params, batch = setup(variant)
    results = {}
    for name, dev in (("tpu", jax.devices()[0]), ("cpu", cpu)):
      with jax.default_device(dev):
        p = jax.device_put(params, dev)
        b = jax.device_put(batch, dev)
        l, g = fn(p, b)
        results[name] = (float(l), jax.tree.map(np.asarray, g))
    (lt, gt), (lc, gc) = results["tpu"], results["cpu"]
    errs = leaf_errors(gt, gc)
    worst = sorted(errs.items(), key=lambda kv: -kv[1])[:10]
    print(json.dumps({"variant": variant, "loss_rel": abs(lt - lc) / abs(lc),
                      "worst_leaves": worst}), flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
