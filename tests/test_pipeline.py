"""Pipeline parallelism (layers/pipeline.py, the pattern stack's `_pipelined`): the schedule's loop
against a NumPy oracle, training on 2 and 4 stages (x fsdp 2, circular repeats, expert
parallelism) against one device, a stage-2 checkpoint restored on 1 and 4 stages bitwise, and the
refusals of combinations that cannot run (exit 2 naming the keys)."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BASE_YML, argv, train
from MaxText.config.load import ConfigError, load_config
from MaxText.layers import pipeline
from MaxText.resolve.config_checks import validate
from MaxText.sharding.mesh import create_mesh
from MaxText.sharding.rules import parse_rules, use_rules

BASE = ("steps=3", "num_decoder_layers=4", "log_period=1")
ONE = ("ici_fsdp_parallelism=1", "per_device_batch_size=8")       # 8 rows on 1 device
LLAMA = ()
QWEN3_MOE = ("model_name=qwen3-moe-tiny",)
# (name, devices, overrides): the global batch stays 8 rows
MESHES = {
    "pp2": (2, ("ici_pipeline_parallelism=2", "ici_fsdp_parallelism=1", "per_device_batch_size=4")),
    "pp4": (4, ("ici_pipeline_parallelism=4", "ici_fsdp_parallelism=1", "per_device_batch_size=2",
                "num_pipeline_microbatches=4")),
}


def _host(tree):
  return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


def _losses(rows):
  return np.asarray([r["loss"] for r in rows])


# ---- the loop against NumPy ---------------------------------------------------------------------
def test_schedule_loop_matches_sequential_stages():
  """4 stages x 2 repeats (8 virtual stages) over 4 microbatches, fsdp 2: the carry's per-token
  part goes through the virtual stages in order, its statistic adds up over microbatches, and the
  gradients are those of the plain sequence of stages."""
  cfg = load_config([BASE_YML, "ici_pipeline_parallelism=4", "ici_fsdp_parallelism=2"])
  mesh, rules = create_mesh(cfg, jax.devices()), parse_rules(cfg.logical_axis_rules, cfg.mesh_axes)
  S, M, R, B, T, D = 4, 4, 2, 8, 3, 5
  sched = pipeline.Schedule(S, M, R)
  rng = np.random.default_rng(0)
  w = rng.normal(size=(R * S, D, D)).astype(np.float32) / np.sqrt(D)
  x0 = rng.normal(size=(B, T, D)).astype(np.float32)
  bias = rng.normal(size=(B, T, D)).astype(np.float32)

  def stage_fn(weights, micro, c, m):
    del m
    x = jnp.tanh(c["x"] @ weights + micro[0])
    return {"x": x, "n": c["n"] + jnp.sum(x)}

  def piped(w_, x_):
    with use_rules(mesh, rules):
      carry = {"x": x_, "n": jnp.float32(1.5)}
      out = pipeline.run(sched, stage_fn, w_.reshape(R, S, D, D), carry,
                         pipeline.batched_like(carry, B, T), [pipeline.split(jnp.asarray(bias), M)])
    return out["x"], out["n"]

  def plain(w_, x_):
    n = jnp.float32(1.5)
    for v in range(R * S):
      x_ = jnp.tanh(x_ @ w_[v] + bias)
      n = n + jnp.sum(x_)
    return x_, n

  x_ref, n_ref = x0, 1.5
  for v in range(R * S):
    x_ref = np.tanh(x_ref @ w[v] + bias)
    n_ref += float(np.sum(x_ref))
  x_got, n_got = jax.jit(piped)(w, x0)
  np.testing.assert_allclose(np.asarray(x_got), x_ref, rtol=0, atol=1e-5)
  np.testing.assert_allclose(float(n_got), n_ref, rtol=1e-5)
  loss = lambda f: lambda w_: jnp.sum(f(w_, x0)[0] ** 2) + 0.01 * f(w_, x0)[1]
  g_got, g_ref = jax.jit(jax.grad(loss(piped)))(w), jax.jit(jax.grad(loss(plain)))(w)
  np.testing.assert_allclose(np.asarray(g_got), np.asarray(g_ref), rtol=1e-5, atol=1e-5)


def test_bubble_fraction():
  assert pipeline.Schedule(4, 4).bubble_fraction == pytest.approx(3 / 7)
  assert pipeline.Schedule(4, 8, 2).bubble_fraction == pytest.approx(3 / 19)
  assert pipeline.Schedule(2, 2).iterations == 3


# ---- training against one device ----------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """The one-device reference of each model, computed once."""
  out = tmp_path_factory.mktemp("pp")
  cache = {}

  def get(model, mesh):
    key = (model, mesh)
    if key not in cache:
      if mesh == "one":
        n, overrides = 1, ONE
      else:
        n, overrides = MESHES[mesh]
      name = f"{'_'.join(model) or 'llama'}_{mesh}".replace("=", "-")
      extra = ("checkpoint_period=3",) if (model, mesh) == (LLAMA, "pp2") else (
          "enable_checkpointing=false",)
      code, rows, state = train(out, name, *BASE, *model, *overrides, *extra,
                                devices=jax.devices()[:n])
      assert code == 0
      cache[key] = (rows, state, out / name)
    return cache[key]
  return get


# Each mesh once, not every model on every mesh: the schedule is the same code whatever the stage
# function it runs. llama on 2 and 4 stages (the 2-stage run's checkpoint is restored below),
# Qwen3-MoE's experts on 2 stages x expert 2 x fsdp 2, circular (below).
@pytest.mark.parametrize("model,mesh", [(LLAMA, "pp2"), (LLAMA, "pp4")],
                         ids=["llama-pp2", "llama-pp4"])
def test_pipeline_matches_one_device(runs, model, mesh):
  ref, _, _ = runs(model, "one")
  got, state, _ = runs(model, mesh)
  np.testing.assert_allclose(_losses(got), _losses(ref), rtol=0, atol=1e-5)
  # the stacked layers really are split over the stages
  q = state["params"]["decoder"]["runs"][0][0]["attn"]["query"]["kernel"]
  assert "stage" in str(q.sharding.spec[0])


def test_circular_pipeline_with_expert_and_fsdp_parallelism_matches_one_device(runs, tmp_path):
  """2 stages x 2 repeats (layers 0, 2 on stage 0; 1, 3 on stage 1) x expert 2 x fsdp 2, 2
  microbatches: Qwen3-MoE. (Stages x fsdp and stages x expert were a run each: one 8-device run
  compiles less than two 4-device ones, and takes every path both took.)"""
  ref, _, _ = runs(QWEN3_MOE, "one")
  code, got, state = train(tmp_path, "circ", *BASE, *QWEN3_MOE, "ici_pipeline_parallelism=2",
                           "ici_expert_parallelism=2", "ici_fsdp_parallelism=2",
                           "per_device_batch_size=1", "num_pipeline_repeats=2",
                           "num_pipeline_microbatches=2", "enable_checkpointing=false")
  assert code == 0
  np.testing.assert_allclose(_losses(got), _losses(ref), rtol=0, atol=1e-5)
  q = state["params"]["decoder"]["runs"][0][0]["attn"]["query"]["kernel"]
  assert "stage" in str(q.sharding.spec[0]) and q.sharding.shard_shape(q.shape)[1] < q.shape[1]


def test_unscanned_layers_tensor_parallel_full_remat_match_one_device(runs, tmp_path):
  """2 stages x tensor 2, the layers unscanned (each stage gathers its layers one by one), full
  remat."""
  unscanned = ("scan_layers=false", "remat_policy=full")
  ref, _, _ = runs(unscanned, "one")
  code, got, _ = train(tmp_path, "tp", *BASE, *unscanned, "ici_pipeline_parallelism=2",
                       "ici_tensor_parallelism=2", "ici_fsdp_parallelism=1",
                       "per_device_batch_size=2", "enable_checkpointing=false",
                       devices=jax.devices()[:4])
  assert code == 0
  np.testing.assert_allclose(_losses(got), _losses(ref), rtol=0, atol=1e-5)


def test_stage_boundary_inside_a_run_matches_one_device(tmp_path):
  """Gemma 4's full layer then a full layer on its K/V (kv-shared): on 2 stages the position of
  the two stages differs in kind (both branches of the switch run), and the K/V go from stage 0
  to stage 1.

  A layer a stage: the boundary needs one on each side, not more (Gemma 4's last layer is full, so
  the pair is full). [sliding, full] then the same shared ran the same switch and hand-on once more
  per kind, at 10 CPU s more; the pipeline sees a layer only as its kind and its carry, and sliding
  layers under sharding are tests/test_gemma4_train.py's (and the windowed op under context
  parallelism tests/test_context_parallel.py's)."""
  gemma = ("model_name=gemma4-tiny", "num_decoder_layers=2", "attention_pattern=f",
           "num_kv_shared_layers=1", "learning_rate=3e-4", "attention=dot_product",
           "enable_checkpointing=false")
  _, ref, _ = train(tmp_path, "one", *BASE, *gemma, *ONE, devices=jax.devices()[:1])
  code, got, _ = train(tmp_path, "pp", *BASE, *gemma, *MESHES["pp2"][1],
                       devices=jax.devices()[:2])
  assert code == 0
  np.testing.assert_allclose(_losses(got), _losses(ref), rtol=0, atol=1e-5)


# ---- checkpoints do not depend on the stage count -----------------------------------------------
@pytest.mark.parametrize("devices,mesh", [(1, ONE), (4, MESHES["pp4"][1])], ids=["one", "pp4"])
def test_stage2_checkpoint_restores_bitwise(runs, devices, mesh):
  from MaxText.checkpoint.manager import RunCheckpoints
  from MaxText.train.loop import Trainer
  _, saved, run_dir = runs(LLAMA, "pp2")
  cfg = load_config(argv(run_dir.parent, run_dir.name, *BASE, *mesh))
  trainer = Trainer(cfg, jax.devices()[:devices])
  ckpts = RunCheckpoints(str(run_dir / "checkpoints"), max_to_keep=3, async_save=False)
  state, meta = ckpts.restore(3, trainer.abstract, None)
  ckpts.close()
  assert meta["step"] == 3
  for a, b in zip(jax.tree.leaves(_host(saved["params"])), jax.tree.leaves(_host(state["params"]))):
    np.testing.assert_array_equal(a, b)


# ---- refusals -----------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides,message", [
    (("num_decoder_layers=3", "ici_pipeline_parallelism=2"),
     "num_decoder_layers / ici_pipeline_parallelism / dcn_pipeline_parallelism / "
     "num_pipeline_repeats: num_decoder_layers=3 does not split into 2 stages x 1 repeats"),
    (("num_decoder_layers=4", "ici_pipeline_parallelism=2", "num_pipeline_repeats=2",
      "num_pipeline_microbatches=1"),
     "num_pipeline_microbatches / num_pipeline_repeats: a circular pipeline"),
    (("ici_pipeline_parallelism=2", "num_pipeline_microbatches=3"),
     "num_pipeline_microbatches / per_device_batch_size: num_pipeline_microbatches=3 does not "
     "divide the 16 rows"),
])
def test_bad_combinations_name_the_keys(overrides, message):
  cfg = load_config([BASE_YML, "per_device_batch_size=2", *overrides])
  with pytest.raises(ConfigError, match=re.escape(message)):
    validate(cfg, jax.devices())


def test_bad_combination_exits_2(tmp_path, capsys):
  code, _, _ = train(tmp_path, "bad", "num_decoder_layers=3", "ici_pipeline_parallelism=2",
                     "ici_fsdp_parallelism=1", devices=jax.devices()[:2])
  assert code == 2
  assert "num_decoder_layers=3 does not split into 2 stages" in capsys.readouterr().err


def test_memory_estimate_counts_the_schedule():
  """A stage keeps its layers' residuals for every iteration, the bubble's included: 2 stages x 2
  microbatches keep (2 + 1) / 2 times the layers' part; the rest (working set of one microbatch of
  the stage's doubled rows, logits) is unchanged."""
  from MaxText.models.model_config import ModelConfig
  from MaxText.train.memory import activation_bytes
  mcfg = lambda n: ModelConfig.from_config(load_config([BASE_YML, f"num_decoder_layers={n}"]))
  plain = {n: activation_bytes(mcfg(n), rows=4, seq=64) for n in (2, 4)}
  piped = activation_bytes(mcfg(4), rows=4, seq=64, schedule=pipeline.Schedule(2, 2))
  layers_part = 2 * (plain[4] - plain[2])            # L = 4 layers' residuals
  assert abs(piped - (plain[4] + layers_part // 2)) <= 2
