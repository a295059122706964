"""`param_init_rng`: every generator (threefry2x32, what `auto` picks on the CPU; rbg off it) cuts
the normal parameters from a few large draws (`model_def._drawn_flat`), not one draw per array."""
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


def _init(mcfg, per_array=False):
  """The flattened init of seed 0 (per_array: the per-array draws the model's modules make, which
  the flat draws replace), with each parameter's init_std."""
  build = get_family(mcfg.decoder_block).build

  def own():
    key = jax.random.key(0, impl=mcfg.param_init_rng)
    return nnx.to_pure_dict(nnx.state(md._build(build, mcfg, key)))  # pylint: disable=protected-access

  flat = traverse_util.flatten_dict(jax.device_get(jax.jit(
      own if per_array else lambda: md.init_traced(build, mcfg, 0))()))
  abstract = nnx.eval_shape(lambda: md._build(build, mcfg, 0))  # pylint: disable=protected-access
  stds = {path: var.get_metadata().get("init_std")
          for path, var in nnx.to_flat_state(nnx.state(abstract))}
  return {k: np.asarray(v, np.float64) for k, v in flat.items()}, stds


@pytest.mark.parametrize("model,rng", [("qwen3-tiny", "threefry2x32"), ("qwen3-next-tiny", "rbg")])
def test_flat_draws_give_each_parameter_its_own_normal_values(model, rng, monkeypatch):
  # draws of at most 5,000 values: several groups, arrays cut at group edges
  monkeypatch.setattr(md, "FLAT_DRAW_ELEMENTS", 5000)
  mcfg = _mcfg(f"model_name={model}", f"param_init_rng={rng}")
  flat, stds = _init(mcfg)
  per_array, _ = _init(mcfg, per_array=True)     # the modules' own draws of the same key
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


def test_the_draws_are_consecutive_slices_of_the_keys_normals():
  """threefry2x32 (the CPU's and the platform-independent generator): the first drawn array is
  std x the first values of `normal(fold_in(fold_in(key, 1), 0))`, JAX's own draw of the flat
  group, reshaped; the next array continues where it ends."""
  mcfg = _mcfg("model_name=qwen3-tiny", "param_init_rng=threefry2x32")
  flat, stds = _init(mcfg)
  build = get_family(mcfg.decoder_block).build
  abstract = nnx.eval_shape(lambda: md._build(build, mcfg, 0))  # pylint: disable=protected-access
  order = [path for path, var in nnx.to_flat_state(nnx.state(abstract))
           if var.get_metadata().get("init_std") is not None]
  sizes = [flat[p].size for p in order]
  key = jax.random.fold_in(jax.random.fold_in(jax.random.key(0, impl="threefry2x32"), 1), 0)
  normals = np.asarray(jax.random.normal(key, (sum(sizes),), np.float32), np.float64)
  start = 0
  for path, n in list(zip(order, sizes))[:2]:
    want = (stds[path] * normals[start:start + n]).astype(np.float32).reshape(flat[path].shape)
    np.testing.assert_allclose(flat[path], want, rtol=1e-6, atol=0, err_msg=str(path))
    start += n
