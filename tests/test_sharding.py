"""Sharding: logical axis rules → PartitionSpecs on real meshes, parallelism filling, the sharding
report, activation constraints and the optimizer-state shardings."""
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import BASE_YML, ROOT
from MaxText.config.load import ConfigError, load_config
from MaxText.config.schema import MESH_AXES
from MaxText.models.model_config import ModelConfig
from MaxText.config.parallelism import fill_parallelism
from MaxText.sharding.mesh import create_mesh
from MaxText.sharding.rules import (constrain, logical_to_spec, parse_rules, sharding_report,
                                    tree_shardings, use_rules)
from MaxText.train.optimizer import make_optimizer
from MaxText.models.registry import make_model_def
from MaxText.train.state import state_shardings

MESH_222 = ("ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2")
MESH_F8 = ("ici_fsdp_parallelism=8",)
MESH_E4F2 = ("ici_expert_parallelism=4", "ici_fsdp_parallelism=2")
EMBED_ALL = ("fsdp", "context", "expert")  # the first "embed" rule of base.yml
ACT = ("activation_batch", "activation_length", "activation_embed")


def mesh_and_rules(*overrides):
  cfg = load_config([BASE_YML, *overrides])
  return create_mesh(cfg, jax.devices()), parse_rules(cfg.logical_axis_rules, cfg.mesh_axes), cfg


def spec(logical, shape, *overrides):
  mesh, rules, _ = mesh_and_rules(*overrides)
  return logical_to_spec(logical, shape, rules, mesh)


# ---- the mesh itself ----------------------------------------------------------------------------
@pytest.mark.parametrize("overrides,shape", [
    (MESH_222, {"data": 2, "stage": 1, "fsdp": 2, "context": 1, "expert": 1, "tensor": 2}),
    (MESH_F8, {"data": 1, "stage": 1, "fsdp": 8, "context": 1, "expert": 1, "tensor": 1}),
    (MESH_E4F2, {"data": 1, "stage": 1, "fsdp": 2, "context": 1, "expert": 4, "tensor": 1}),
    ((), {"data": 1, "stage": 1, "fsdp": 8, "context": 1, "expert": 1, "tensor": 1}),  # fsdp -1 fills
])
def test_create_mesh_shape(overrides, shape):
  mesh, _, _ = mesh_and_rules(*overrides)
  assert mesh.axis_names == MESH_AXES
  assert dict(mesh.shape) == shape
  assert sorted(d.id for d in mesh.devices.flat) == list(range(8))


# ---- logical_to_spec ----------------------------------------------------------------------------
@pytest.mark.parametrize("overrides,expected", [
    (MESH_222, {
        "mlp": P(EMBED_ALL, "tensor"),
        "vocab": P("tensor", EMBED_ALL),
        "attn": P("stage", EMBED_ALL, "tensor", None),   # stage 1: the layers whole
        "act": P(("data", "stage", "fsdp", "expert"), "context", None),
    }),
    (MESH_F8, {
        "mlp": P(EMBED_ALL, "tensor"),
        "vocab": P("tensor", EMBED_ALL),
        "attn": P("stage", EMBED_ALL, "tensor", None),   # stage 1: the layers whole
        "act": P(("data", "stage", "fsdp", "expert"), "context", None),
    }),
    (MESH_E4F2, {
        "mlp": P(EMBED_ALL, "tensor"),
        "vocab": P("tensor", EMBED_ALL),
        "attn": P("stage", EMBED_ALL, "tensor", None),   # stage 1: the layers whole
        "act": P(("data", "stage", "fsdp", "expert"), "context", None),
    }),
])
def test_base_rules_map_to_expected_specs(overrides, expected):
  mesh, rules, _ = mesh_and_rules(*overrides)
  got = {
      "mlp": logical_to_spec(("embed", "mlp"), (64, 128), rules, mesh),
      "vocab": logical_to_spec(("vocab", "embed"), (264, 64), rules, mesh),
      "attn": logical_to_spec(("layers", "embed", "heads", "head_dim"), (2, 64, 4, 16), rules, mesh),
      "act": logical_to_spec(ACT, (8, 64, 64), rules, mesh),
  }
  assert got == expected
  # the spec really shards as intended: shard shapes on the mesh
  sh = NamedSharding(mesh, got["mlp"]).shard_shape((64, 128))
  assert sh == (64 // (mesh.shape["fsdp"] * mesh.shape["expert"]), 128 // mesh.shape["tensor"])


def test_embed_falls_back_when_not_divisible():
  # expert 4 x fsdp 2: the first embed rule needs a multiple of 8, the second ("fsdp","context") 2
  assert spec(("embed", "mlp"), (4, 6), *MESH_E4F2) == P(("fsdp", "context"), "tensor")
  assert spec(("embed",), (8,), *MESH_E4F2) == P(EMBED_ALL)
  assert spec(("embed",), (3,), *MESH_E4F2) == P(None)  # no rule fits → replicated


def test_embed_falls_back_when_axis_already_used():
  # "exp" takes the expert axis, so the first embed rule (which includes expert) is skipped
  assert spec(("exp", "embed"), (4, 64), *MESH_E4F2) == P("expert", ("fsdp", "context"))
  # data 2 fsdp 2 tensor 2: activation_batch uses fsdp; every embed rule needs fsdp → replicated
  assert spec(("activation_batch", "embed"), (8, 64), *MESH_222) == P(
      ("data", "stage", "fsdp", "expert"), None)
  # one mesh axis is never used twice in a spec, even for two dimensions of the same name
  assert spec(("mlp", "mlp"), (4, 4), *MESH_222) == P("tensor", None)


def test_undividable_or_unknown_dimensions_are_replicated():
  assert spec(("mlp",), (3,), *MESH_222) == P(None)
  assert spec(("heads", "head_dim"), (5, 16), *MESH_222) == P(None, None)
  assert spec(ACT, (3, 64, 64), *MESH_222) == P(None, "context", None)  # 3 rows over 4-way dp
  assert spec(("no_such_name", None), (8, 8), *MESH_222) == P(None, None)
  with pytest.raises(ValueError):
    spec(("embed", "mlp"), (64,), *MESH_222)


def test_rules_are_taken_in_order():
  mesh, _, _ = mesh_and_rules(*MESH_222)
  rules = parse_rules([["x", ["data", "fsdp", "tensor"]], ["x", ["tensor"]], ["y", "data"],
                       ["z", None]], MESH_AXES)
  assert rules == (("x", ("data", "fsdp", "tensor")), ("x", ("tensor",)), ("y", ("data",)),
                   ("z", ()))
  assert logical_to_spec(("x",), (8,), rules, mesh) == P(("data", "fsdp", "tensor"))
  assert logical_to_spec(("x",), (6,), rules, mesh) == P("tensor")
  assert logical_to_spec(("y", "x"), (8, 8), rules, mesh) == P("data", "tensor")
  assert logical_to_spec(("x", "y"), (8, 8), rules, mesh) == P(("data", "fsdp", "tensor"), None)
  assert logical_to_spec(("y", "x", "x"), (8, 8, 8), rules, mesh) == P("data", "tensor", None)
  assert logical_to_spec(("z", "x"), (8, 8), rules, mesh) == P(None, ("data", "fsdp", "tensor"))


def test_parse_rules_errors():
  with pytest.raises(ConfigError, match=r"logical_axis_rules\[1\].*'pipe'"):
    parse_rules([["a", None], ["b", ["pipe"]]], MESH_AXES)
  with pytest.raises(ConfigError, match=r"logical_axis_rules\[0\]"):
    parse_rules([["a", "data", "extra"]], MESH_AXES)


# ---- fill_parallelism ---------------------------------------------------------------------------
def test_fill_parallelism_fills_the_hole():
  assert fill_parallelism([1, 1, -1, 1, 1, 2], 8, "ici", MESH_AXES) == [1, 1, 4, 1, 1, 2]
  assert fill_parallelism([-1, 1, 1, 1, 1, 1], 1, "dcn", MESH_AXES) == [1, 1, 1, 1, 1, 1]
  assert fill_parallelism([2, 1, 2, 1, 1, 2], 8, "ici", MESH_AXES) == [2, 1, 2, 1, 1, 2]


def test_fill_parallelism_rejects_two_holes():
  with pytest.raises(ConfigError) as e:
    fill_parallelism([-1, 1, 1, 1, 1, -1], 8, "ici", MESH_AXES)
  assert "ici_data_parallelism" in str(e.value) and "ici_tensor_parallelism" in str(e.value)
  assert "ici_fsdp_parallelism" not in str(e.value)


def test_fill_parallelism_rejects_wrong_products():
  with pytest.raises(ConfigError) as e:
    fill_parallelism([1, 1, 3, 1, 1, 1], 8, "ici", MESH_AXES)
  assert "ici_fsdp_parallelism=3" in str(e.value) and "8" in str(e.value)
  with pytest.raises(ConfigError) as e:
    fill_parallelism([1, 1, 1, 1, 2, 1], 1, "dcn", MESH_AXES)
  assert "dcn_expert_parallelism=2" in str(e.value)
  with pytest.raises(ConfigError) as e:  # fixed sizes 3 do not divide 8: the keys are named
    fill_parallelism([3, 1, -1, 1, 1, 1], 8, "ici", MESH_AXES)
  assert "ici_data_parallelism=3 = 3 does not divide the 8 devices" in str(e.value)
  assert "ici_fsdp_parallelism=-1" in str(e.value)
  with pytest.raises(ConfigError) as e:
    fill_parallelism([1, 1, 0, 1, 1, 1], 8, "ici", MESH_AXES)
  assert "ici_fsdp_parallelism=0" in str(e.value)
  with pytest.raises(ConfigError) as e:
    fill_parallelism([1, 1, -2, 1, 1, 1], 8, "ici", MESH_AXES)
  assert "ici_fsdp_parallelism=-2" in str(e.value)
  with pytest.raises(ConfigError) as e:  # the stage axis is sized by the pipeline keys
    fill_parallelism([1, 3, -1, 1, 1, 1], 8, "ici", MESH_AXES)
  assert "ici_pipeline_parallelism=3 = 3 does not divide the 8 devices" in str(e.value)


# ---- sharding_report ----------------------------------------------------------------------------
def test_sharding_report_numbers_are_exact():
  mesh, _, _ = mesh_and_rules(*MESH_222)
  shapes = {"a": jax.ShapeDtypeStruct((1024, 1024), jnp.float32),   # 4 MiB, sharded 4-way → 1 MiB
            "b": jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16),   # 1 MiB, replicated
            "c": {"d": jax.ShapeDtypeStruct((256, 1024), jnp.float32)}}  # 1 MiB, 2-way → 0.5 MiB
  shardings = {"a": NamedSharding(mesh, P(("data", "fsdp"), None)),
               "b": NamedSharding(mesh, P()),
               "c": {"d": NamedSharding(mesh, P(None, "tensor"))}}
  assert sharding_report(shapes, shardings) == (
      "parameters: 6.0 MiB in all, 2.50 MiB per device; 83.3% of parameter bytes sharded "
      "(split over data 66.7%, fsdp 66.7%, tensor 16.7%)")
  # a spec over size-1 axes only is not sharding anything
  f8, _, _ = mesh_and_rules(*MESH_F8)
  only = {"a": jax.ShapeDtypeStruct((1024, 1024), jnp.float32)}
  assert sharding_report(only, {"a": NamedSharding(f8, P("tensor", "context"))}) == (
      "parameters: 4.0 MiB in all, 4.00 MiB per device; 0.0% of parameter bytes sharded")
  assert sharding_report(only, {"a": NamedSharding(f8, P("fsdp"))}) == (
      "parameters: 4.0 MiB in all, 0.50 MiB per device; 100.0% of parameter bytes sharded "
      "(split over fsdp 100.0%)")
  # the stacked layers over 4 stages x fsdp 2
  s4, _, _ = mesh_and_rules("ici_pipeline_parallelism=4", "ici_fsdp_parallelism=2")
  layers = {"a": jax.ShapeDtypeStruct((4, 1024, 1024), jnp.float32)}
  assert sharding_report(layers, {"a": NamedSharding(s4, P("stage", "fsdp"))}) == (
      "parameters: 16.0 MiB in all, 2.00 MiB per device; 100.0% of parameter bytes sharded "
      "(split over stage 100.0%, fsdp 100.0%)")


# ---- constrain ----------------------------------------------------------------------------------
def test_constrain_is_a_no_op_outside_use_rules():
  x = jnp.ones((8, 16, 4))
  assert constrain(x, ACT) is x
  jaxpr = str(jax.make_jaxpr(lambda x: constrain(x * 2, ACT))(x))
  assert "sharding_constraint" not in jaxpr


def test_constrain_applies_the_rule_inside_use_rules():
  mesh, rules, _ = mesh_and_rules(*MESH_222)
  x = jnp.arange(8 * 16 * 4, dtype=jnp.float32).reshape(8, 16, 4)
  seen = []
  def f(x):
    y = constrain(x * 2, ACT)
    jax.debug.inspect_array_sharding(y, callback=seen.append)
    return y
  with use_rules(mesh, rules):
    assert "sharding_constraint" in str(jax.make_jaxpr(f)(x))
    out = jax.jit(f)(x)
  expected = P(("data", "stage", "fsdp", "expert"), "context", None)
  assert out.sharding.is_equivalent_to(NamedSharding(mesh, expected), 3)
  assert out.sharding.shard_shape(out.shape) == (2, 16, 4)
  assert seen and seen[-1].is_equivalent_to(NamedSharding(mesh, expected), 3)
  np.testing.assert_array_equal(np.asarray(out), 2 * np.asarray(x))
  # the context is gone after the with-block
  assert constrain(x, ACT) is x


# ---- train-state shardings ----------------------------------------------------------------------
TINY_MODEL = ("emb_dim=64", "num_decoder_layers=2", "num_query_heads=4", "num_kv_heads=2",
              "head_dim=16", "mlp_dim=128", "vocab_size=264")


@pytest.mark.parametrize("extra", [(), ("max_grad_norm=0",), ("scan_layers=false",)])
def test_optimizer_moments_follow_the_parameters(extra):
  mesh, rules, cfg = mesh_and_rules(*MESH_222, *TINY_MODEL, *extra)
  model_def = make_model_def(ModelConfig.from_config(cfg))
  tx = make_optimizer(cfg, model_def.logical_axes)
  sh = state_shardings(model_def, tx, mesh, rules)
  params = sh["params"]
  replicated = NamedSharding(mesh, P())
  assert sh["step"] == replicated
  # the parameters really are sharded (otherwise the comparison below would be vacuous)
  q = params["decoder"]["runs"][0][0]["attn"]["query"]["kernel"] if cfg.scan_layers else \
      params["decoder"]["layers"][0]["attn"]["query"]["kernel"]
  assert q.spec == (P("stage", EMBED_ALL, "tensor", None) if cfg.scan_layers
                    else P(EMBED_ALL, "tensor", None))
  assert params["embedding"].spec == P("tensor", EMBED_ALL)

  adam = []
  def find(node):
    if hasattr(node, "mu") and hasattr(node, "nu"):
      adam.append(node)
    elif isinstance(node, (tuple, list)):
      for n in node:
        find(n)
  find(sh["opt_state"])
  assert len(adam) == 1
  for moment in (adam[0].mu, adam[0].nu):
    assert jax.tree.structure(moment) == jax.tree.structure(params)
    for got, want in zip(jax.tree.leaves(moment), jax.tree.leaves(params)):
      assert got == want
  assert adam[0].count == replicated


def test_multi_slice_hybrid_grid_puts_dcn_outermost():
  """Two slices of four devices: dcn_data=-1 fills 2 slices, ici_fsdp=-1 fills 4 per slice, and
  every row of the data axis lies within one slice (only data-parallel traffic crosses DCN)."""
  import types
  from MaxText.sharding.mesh import device_grid, mesh_shape
  devices = [types.SimpleNamespace(id=i, slice_index=i // 4, process_index=i // 4, platform="cpu",
                                   device_kind="cpu") for i in range(8)]
  cfg = load_config([BASE_YML])
  assert mesh_shape(cfg, devices) == ([1, 1, 4, 1, 1, 1], [2, 1, 1, 1, 1, 1])
  grid = device_grid(cfg, devices)
  assert grid.shape == (2, 1, 4, 1, 1, 1)
  assert [{d.slice_index for d in row.ravel()} for row in grid] == [{0}, {1}]
  with pytest.raises(ConfigError, match="dcn"):
    mesh_shape(load_config([BASE_YML, "dcn_data_parallelism=1", "dcn_fsdp_parallelism=1"]), devices)
  # pipeline stages across the slices: each stage's devices lie within one slice
  staged = load_config([BASE_YML, "dcn_data_parallelism=1", "dcn_pipeline_parallelism=2"])
  assert mesh_shape(staged, devices) == ([1, 1, 4, 1, 1, 1], [1, 2, 1, 1, 1, 1])
  grid = device_grid(staged, devices)
  assert [{d.slice_index for d in grid[:, s].ravel()} for s in range(2)] == [{0}, {1}]


# ---- every shipped model shards its large parameters under fsdp ------------------------------------
SHIPPED_MODELS = sorted(f[:-4] for f in os.listdir(os.path.join(ROOT, "configs", "models"))
                        if f.endswith(".yml"))
LARGE_BYTES = 4 * 2**20   # the largest parameter allowed to stay whole: stacked norm scales ~1.5 MiB


@pytest.mark.parametrize("name", SHIPPED_MODELS)
def test_no_large_parameter_is_left_whole_by_fsdp(name):
  """Abstract shapes only (nothing allocated): on fsdp 8 and on fsdp 4 x tensor 2, every parameter
  above LARGE_BYTES keeps at most 1/fsdp of its bytes per device (Gemma 4 E2B's per-layer-input
  table, 8.75 GiB, was copied whole to every device)."""
  mdef = make_model_def(ModelConfig.from_config(load_config([BASE_YML, f"model_name={name}"])))
  whole = []
  for mesh_keys in (MESH_F8, ("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2")):
    mesh, rules, _ = mesh_and_rules(f"model_name={name}", *mesh_keys)
    shardings = tree_shardings(mdef.logical_axes, mdef.abstract_params, mesh, rules)
    for (path, leaf), sharding in zip(jax.tree_util.tree_leaves_with_path(mdef.abstract_params),
                                      jax.tree.leaves(shardings)):
      nbytes = math.prod(leaf.shape) * leaf.dtype.itemsize
      local = math.prod(sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
      if nbytes > LARGE_BYTES and local * mesh.shape["fsdp"] > nbytes:
        whole.append(f"{mesh_keys}: {jax.tree_util.keystr(path)} {leaf.shape}: "
                     f"{local / 2**20:.0f} of {nbytes / 2**20:.0f} MiB per device")
  assert not whole, whole
