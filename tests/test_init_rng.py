"""`param_init_rng`: the rbg generators (what `auto` picks off the CPU) cut the normal parameters
from a few large draws (`model_def._drawn_flat`); threefry2x32 keeps one draw per array."""
import os

import jax
import numpy as np
import pytest
from flax import nnx, traverse_util

from MaxText.config.load import load_config
from MaxText.models import model_def as md
from MaxText.models.model_config import ModelConfig
from MaxText.models.registry import get_family
from MaxText.resolve import auto_settings
from tests.conftest import ROOT


def _mcfg(*keys):
  cfg = load_config([os.path.join(ROOT, "configs/base.yml"), *keys], keep_auto=True)
  return ModelConfig.from_config(auto_settings.for_training(cfg).cfg)


def _init(mcfg):
  build = get_family(mcfg.decoder_block).build
  flat = traverse_util.flatten_dict(jax.device_get(jax.jit(
      lambda: md.init_traced(build, mcfg, 0))()))
  abstract = nnx.eval_shape(lambda: md._build(build, mcfg, 0))  # pylint: disable=protected-access
  stds = {path: var.get_metadata().get("init_std")
          for path, var in nnx.to_flat_state(nnx.state(abstract))}
  return {k: np.asarray(v, np.float64) for k, v in flat.items()}, stds


@pytest.mark.parametrize("model", ["qwen3-tiny", "qwen3-next-tiny"])
def test_flat_draws_give_each_parameter_its_own_normal_values(model, monkeypatch):
  # draws of at most 5,000 values: several groups, arrays cut at group edges
  monkeypatch.setattr(md, "FLAT_DRAW_ELEMENTS", 5000)
  mcfg = _mcfg(f"model_name={model}", "param_init_rng=rbg")
  flat, stds = _init(mcfg)
  monkeypatch.setattr(md, "FLAT_DRAW_RNGS", ())      # the per-array draws of the same key
  per_array, _ = _init(mcfg)
  drawn = [k for k in flat if stds.get(k) is not None]
  assert len(drawn) >= 8, drawn
  for k, v in flat.items():
    if stds.get(k) is None:   # ones, the conv's and decay's own inits: as the per-array program
      np.testing.assert_array_equal(v, per_array[k], err_msg=str(k))
      continue
    assert not np.array_equal(v, per_array[k]), k          # replaced by the flat draw
    assert abs(v.mean()) < 4 * stds[k] / np.sqrt(v.size), (k, v.mean())
    assert abs(v.std() / stds[k] - 1) < 6 / np.sqrt(v.size) + 0.02, (k, v.std(), stds[k])
    if v.ndim >= 3 and v.shape[0] > 1:                      # stacked layers differ
      assert not np.allclose(v[0], v[1]), k
  # no two arrays (or an array and a shifted copy of it) share values
  firsts = [flat[k].ravel()[:64] for k in drawn]
  for i, a in enumerate(firsts):
    for b in firsts[i + 1:]:
      n = min(a.size, b.size)
      assert abs(np.corrcoef(a[:n], b[:n])[0, 1]) < 0.6


def test_threefry_keeps_its_per_array_values(monkeypatch):
  mcfg = _mcfg("model_name=qwen3-tiny", "param_init_rng=threefry2x32")
  flat, _ = _init(mcfg)
  monkeypatch.setattr(md, "FLAT_DRAW_RNGS", ("threefry2x32",))
  assert not np.array_equal(_init(mcfg)[0][("embedding",)], flat[("embedding",)])
  monkeypatch.setattr(md, "FLAT_DRAW_RNGS", ("rbg", "unsafe_rbg"))
  np.testing.assert_array_equal(_init(mcfg)[0][("embedding",)], flat[("embedding",)])
