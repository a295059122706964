"""Embedding lookup under a mesh (`layers/embed.py`): the same rows as a plain take, and no
"Involuntary full rematerialization" from XLA's SPMD partitioner (the table's D split over fsdp
vs. the activation's batch split over data x fsdp)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BASE_YML
from MaxText.config.load import load_config
from MaxText.layers import embed
from MaxText.sharding.mesh import create_mesh
from MaxText.sharding.rules import parse_rules, use_rules

ACT = ("activation_batch", "activation_length", "activation_embed")


@pytest.mark.parametrize("mesh_keys", [
    ("ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"),
    ("ici_data_parallelism=2", "ici_fsdp_parallelism=4"),
])
def test_lookup_is_exact_and_needs_no_full_rematerialization(mesh_keys, capfd):
  cfg = load_config([BASE_YML, *mesh_keys])
  mesh, rules = create_mesh(cfg, jax.devices()), parse_rules(cfg.logical_axis_rules, cfg.mesh_axes)
  V, D, B, S = 64, 16, 8, 12
  table = jax.random.normal(jax.random.key(0), (V, D))
  tokens = jax.random.randint(jax.random.key(1), (B, S), 0, V)

  def f(t, ids):
    with use_rules(mesh, rules):
      x = embed.lookup(t, ids, ("vocab", "embed"), ACT)
      return x, jax.grad(lambda t: jnp.sum(embed.lookup(t, ids, ("vocab", "embed"), ACT) ** 2))(t)

  from jax.sharding import NamedSharding
  from MaxText.sharding.rules import logical_to_spec
  t_sh = NamedSharding(mesh, logical_to_spec(("vocab", "embed"), (V, D), rules, mesh))
  ids_sh = NamedSharding(mesh, logical_to_spec(ACT[:2], (B, S), rules, mesh))
  previous = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)   # compile for real: XLA logs then
  try:
    x, g = jax.jit(f, in_shardings=(t_sh, ids_sh))(jax.device_put(table, t_sh),
                                                   jax.device_put(tokens, ids_sh))
  finally:
    jax.config.update("jax_enable_compilation_cache", previous)
  np.testing.assert_array_equal(np.asarray(x), np.asarray(table)[np.asarray(tokens)])
  want_g = np.zeros((V, D), np.float32)
  np.add.at(want_g, np.asarray(tokens), 2 * np.asarray(table)[np.asarray(tokens)])
  np.testing.assert_allclose(np.asarray(g), want_g, rtol=1e-6)
  assert x.sharding.is_equivalent_to(
      NamedSharding(mesh, logical_to_spec(ACT, (B, S, D), rules, mesh)), 3), x.sharding
  assert "Involuntary full rematerialization" not in capfd.readouterr().err
