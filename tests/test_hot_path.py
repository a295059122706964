"""The one platform choice of the hot path (`MaxText/backend/hot_path.py`): tuned on CPU, plain
(XLA's own dot, autodiff attention and norm, named remat saves) on GPU and TPU, either forced by
`hot_path=`; and the plain path, run on this CPU, training to the tuned path's losses."""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

from conftest import BASE_YML, ROOT, train
from MaxText.backend import hot_path
from MaxText.config.load import ConfigError, load_config
from MaxText.layers.linear import matmul
from MaxText.layers.stack import REMAT_POLICIES
from MaxText.models.model_config import ModelConfig
from MaxText.models.registry import make_model_def
from MaxText.runtime import cpu_devices


@pytest.mark.parametrize("name,platform,path", [
    ("auto", "cpu", "tuned"), ("auto", "gpu", "plain"), ("auto", "cuda", "plain"),
    ("auto", "rocm", "plain"), ("auto", "tpu", "plain"),
    ("tuned", "gpu", "tuned"), ("tuned", "tpu", "tuned"), ("plain", "cpu", "plain"),
])
def test_selection_per_platform(name, platform, path):
  assert hot_path.select_hot_path(name, platform) == path


def test_an_unknown_path_is_refused():
  with pytest.raises(ValueError, match="hot_path='fast'"):
    hot_path.select_hot_path("fast", "cpu")
  with pytest.raises(ConfigError, match="hot_path='fast': must be one of 'auto', 'tuned', 'plain'"):
    load_config([BASE_YML, "hot_path=fast"])   # the config key (exit 2)


def test_the_model_config_resolves_the_key_on_this_platform():
  assert jax.default_backend() == "cpu"
  for given, want in (("auto", "tuned"), ("plain", "plain"), ("tuned", "tuned")):
    mcfg = ModelConfig.from_config(load_config([BASE_YML, f"hot_path={given}"]))
    assert mcfg.hot_path == want
    assert make_model_def(mcfg).hot_path == want


def test_the_default_while_tracing_is_the_platforms_and_use_forces_either():
  assert hot_path.current() == "tuned"                      # this CPU
  with hot_path.use("plain"):
    assert hot_path.current() == "plain" and not hot_path.tuned()
    with hot_path.use("auto"):                              # auto keeps the enclosing choice
      assert hot_path.current() == "plain"
    with hot_path.use("tuned"):
      assert hot_path.tuned()
  assert hot_path.current() == "tuned"


@pytest.mark.parametrize("path,saved", [("tuned", "u16[32,16] named 'matmul_out'"),
                                         ("plain", "bf16[32,16] named 'matmul_out'")])
def test_a_bf16_matmul_output_is_saved_per_path(path, saved, capsys):
  """save_matmuls keeps the weight matmul's output: as its raw bits on the tuned path, as the bf16
  value itself (a plain `checkpoint_name`) on the plain one; both give the same gradients."""
  rng = np.random.RandomState(0)   # host values, put on the device: no program to make them
  x = jax.device_put(rng.randn(32, 24).astype(jnp.bfloat16))
  w = jax.device_put(rng.randn(24, 16).astype(np.float32))
  loss = lambda x, w: jnp.sum(jnp.sin(matmul(x, w)).astype(jnp.float32))
  # each path's gradient one jitted program (traced under its `use`), not one per eager op
  with hot_path.use(path):
    print_saved_residuals(jax.checkpoint(loss, policy=REMAT_POLICIES["save_matmuls"]), x, w)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
  assert saved in capsys.readouterr().out
  with hot_path.use("tuned" if path == "plain" else "plain"):
    other = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
  # dx: both round the same fp32-accumulated dot once to bf16 (an ulp apart at most, through the
  # accumulation order: 2^-8 relative); dw: the plain path rounds it to bf16 before its fp32 cast
  # (2^-9 relative), the tuned path keeps the fp32 accumulator
  for g, h in zip(grads, other):
    g, h = np.asarray(g, np.float32), np.asarray(h, np.float32)
    np.testing.assert_allclose(g, h, rtol=2 ** -7, atol=2 ** -7 * float(np.max(np.abs(h))))


def test_plain_on_cpu_leaves_the_host_allocator_and_the_schedule_alone():
  defaults = cpu_devices.Defaults(None, True)
  assert cpu_devices.apply_host_allocator(defaults, "cpu", hot_path="plain").allocator is False
  assert cpu_devices.apply_host_allocator(defaults, "gpu", hot_path="auto").allocator is False
  probe = ("import os; from MaxText.runtime import cpu_devices; "
           "d = cpu_devices.apply_default(hot_path='{}'); print(d.schedule, "
           "cpu_devices.SCHEDULER_FLAG in os.environ.get('XLA_FLAGS', ''))")
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  for path, want in (("plain", "False False"), ("auto", "True True")):
    out = subprocess.run([sys.executable, "-c", probe.format(path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == want, (path, out)


STEPS = ["steps=6", "log_period=1", "enable_checkpointing=false", "ici_fsdp_parallelism=2",
         "per_device_batch_size=4"]


def _losses(tmp_path, name, *overrides):
  code, rows, _ = train(tmp_path, name, *STEPS, *overrides, devices=jax.devices()[:2])
  assert code == 0
  return np.asarray([r["loss"] for r in rows])


@pytest.fixture(scope="module")
def tuned32(tmp_path_factory):
  """The tuned path's fp32 losses (the oracle of both tests)."""
  return _losses(tmp_path_factory.mktemp("hot"), "tuned32", "dtype=float32", "hot_path=tuned")


def test_plain_path_trains_to_the_tuned_losses_in_float32(tmp_path, tuned32):
  """fp32: the paths differ only in RMSNorm's gradient (hand-written vs autodiff: the same sums
  in another order), so the losses agree to fp32 rounding over six AdamW steps."""
  plain = _losses(tmp_path, "plain32", "dtype=float32", "hot_path=plain")
  np.testing.assert_allclose(plain, tuned32, rtol=1e-6, atol=0)


def test_plain_path_trains_to_the_tuned_losses_in_bfloat16(tmp_path, tuned32):
  """bf16: both compute the same function with fp32 accumulation; they differ in where a value is
  rounded to bf16 (relative u = 2^-9 each: the attention's probabilities before P·V vs its output
  after; the weight gradients before their fp32 cast; the norm scale's gradient). The fp32 run is
  the oracle. The loss is a mean over 8 x 64 tokens of cross-entropies from fp32 logits; roundings
  of relative u in the activations move each token's term by O(u) of its size with either sign,
  and the mean shrinks their sum, so each path stays within one bf16 ulp of the loss (2u
  relative) of fp32 over six AdamW steps — and so within 2u of each other."""
  ref = tuned32
  tuned = _losses(tmp_path, "tunedbf", "dtype=bfloat16", "hot_path=tuned")
  plain = _losses(tmp_path, "plainbf", "dtype=bfloat16", "hot_path=plain")
  err_tuned, err_plain = np.abs(tuned - ref), np.abs(plain - ref)
  print(f"loss fp32 {ref}\n|tuned - fp32| {err_tuned}\n|plain - fp32| {err_plain}\n"
        f"|plain - tuned| {np.abs(plain - tuned)}")
  u = 2.0 ** -9
  assert np.all(err_tuned <= 2 * u * ref) and np.all(err_plain <= 2 * u * ref)
  assert np.all(np.abs(plain - tuned) <= 2 * u * ref)


@pytest.mark.parametrize("given,want", [("plain", "plain"), ("auto", "tuned")])
def test_the_decoding_engine_traces_the_models_path(given, want, monkeypatch):
  """The engine merges the model itself (not through `ModelDef`'s calls): it traces its programs
  on `ModelConfig.hot_path` too."""
  from decoding_helpers import engine   # pylint: disable=import-outside-toplevel
  from MaxText.layers import linear     # pylint: disable=import-outside-toplevel
  from MaxText.models.registry import init_params   # pylint: disable=import-outside-toplevel
  mcfg = ModelConfig.from_config(load_config([BASE_YML, "model_name=qwen3-tiny", "dtype=bfloat16",
                                              f"hot_path={given}"]))
  seen, real, real_contract = set(), linear.matmul, linear.contract
  # the weight matmuls: `matmul` (the tuned path's 2-D form) or `contract` (the plain path's)
  monkeypatch.setattr(linear, "matmul", lambda *a, **k: seen.add(hot_path.current()) or real(*a, **k))
  monkeypatch.setattr(linear, "contract",
                      lambda *a, **k: seen.add(hot_path.current()) or real_contract(*a, **k))
  eng = engine(mcfg, batch_size=1)
  eng.generate(eng.place(jax.device_get(init_params(mcfg, 0))), [[5, 6, 7]], max_new_tokens=2)
  assert seen == {want}
