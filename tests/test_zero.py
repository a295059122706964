"""The optimizer state sharded over the data axes (ZeRO-1, `shard_optimizer_over_data`): the
moments' shardings, training equal to the replicated optimizer, checkpoints restoring across the
setting and the mesh, the memory pre-flight's count — and the fused AdamW resuming a checkpoint
the optax chain wrote."""
import jax
import numpy as np
import optax

from conftest import MESH_1, MESH_222, argv, train
from MaxText.config.load import load_config
from MaxText.train import memory
from MaxText.train import loop as loop_module
from MaxText.train.loop import Trainer
from optax_oracle import with_chain

ZERO = "shard_optimizer_over_data=true"   # the default; spelled out where it is compared with
OFF = "shard_optimizer_over_data=false"


def _host(tree):
  return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


def _mu(opt_state):
  is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)
  return [s.mu for s in jax.tree.leaves(opt_state, is_leaf=is_adam) if is_adam(s)][0]


def _axes(spec):
  return {a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)}


def test_moments_take_the_data_axis_and_memory_counts_it(tmp_path):
  on = Trainer(load_config(argv(tmp_path, "on", *MESH_222, ZERO)))
  off = Trainer(load_config(argv(tmp_path, "off", *MESH_222, OFF)))
  assert on.shardings["params"] == off.shardings["params"]
  assert _mu(off.shardings["opt_state"]) == off.shardings["params"]
  q_param = on.shardings["params"]["decoder"]["runs"][0][0]["attn"]["query"]["kernel"]
  q_mu = _mu(on.shardings["opt_state"])["decoder"]["runs"][0][0]["attn"]["query"]["kernel"]
  assert "data" not in _axes(q_param.spec) and _axes(q_mu.spec) == _axes(q_param.spec) | {"data"}
  assert q_mu.spec[0] == q_param.spec[0]   # never on the scanned layers' axis (its own: stage)
  for mu, param in zip(jax.tree.leaves(_mu(on.shardings["opt_state"])),
                       jax.tree.leaves(on.shardings["params"])):
    assert "data" in _axes(mu.spec) or mu == param
  # the pre-flight counts each device's part of the moments: half of them at data = 2 (the
  # leaves that take the axis), everything else unchanged
  est_on = memory.estimate(on.abstract, on.devices)
  est_off = memory.estimate(off.abstract, off.devices)
  assert est_on.params == est_off.params
  halved = sum(memory.per_device_bytes(a) for a, sh in zip(
      jax.tree.leaves(_mu(off.abstract["opt_state"])),
      jax.tree.leaves(_mu(on.shardings["opt_state"]))) if "data" in _axes(sh.spec))
  assert halved > 0 and est_on.optimizer == est_off.optimizer - halved
  # without a data axis > 1 the key changes nothing
  fsdp = Trainer(load_config(argv(tmp_path, "f", "ici_fsdp_parallelism=8", ZERO)))
  assert _mu(fsdp.shardings["opt_state"]) == fsdp.shardings["params"]
  assert on.tx.data_axes == ("data",) and not fsdp.tx.shard_over_data   # the step's plain path
  assert not off.tx.shard_over_data


def test_zero_trains_like_the_replicated_optimizer_and_restores_across(tmp_path):
  """Losses and parameters as without ZeRO (the gradient norm is summed over shards in another
  order: rounding only), and a ZeRO checkpoint restores without it on another mesh, exactly."""
  common = ("steps=4", "checkpoint_period=4", *MESH_222)
  code_on, m_on, s_on = train(tmp_path, "on", *common, ZERO)
  code_off, m_off, s_off = train(tmp_path, "off", *common, OFF)
  assert code_on == code_off == 0
  np.testing.assert_allclose([m["loss"] for m in m_on], [m["loss"] for m in m_off],
                             rtol=1e-6, atol=0)
  for a, b in zip(jax.tree.leaves(_host(s_on["params"])), jax.tree.leaves(_host(s_off["params"]))):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
  from MaxText.checkpoint.manager import RunCheckpoints
  for src, saved, target in (("on", s_on, ["ici_fsdp_parallelism=8", OFF]),
                             ("off", s_off, [*MESH_222, ZERO])):
    trainer = Trainer(load_config(argv(tmp_path, src, "steps=4", *target)))
    ckpts = RunCheckpoints(str(tmp_path / src / "checkpoints"), max_to_keep=3, async_save=False)
    state, _ = ckpts.restore(4, trainer.abstract, None)
    ckpts.close()
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(trainer.shardings)):
      assert a.sharding == b
    for a, b in zip(jax.tree.leaves(_host(saved)), jax.tree.leaves(_host(state))):
      np.testing.assert_array_equal(a, b)


def test_fused_adamw_resumes_the_optax_chains_checkpoint_bitwise(tmp_path, monkeypatch,
                                                                users_emitters):
  """A checkpoint written by the optax chain (the state before the fused AdamW) resumes under
  the fused one, and the run continues bit for bit as the chain's would (both steps compiled with
  the users' fusion emitters: tests/conftest.py). On one device: the optimizer's update is the
  same code on any mesh without a data axis (ZeRO's sharded moments are the test above's), and two
  1-device step programs under the users' emitters compile in a fraction of two 8-device ones."""
  common = ("steps=4", "checkpoint_period=2", "max_checkpoints_to_keep=3", *MESH_1)
  fused, chained = loop_module.make_optimizer, []
  monkeypatch.setattr(loop_module, "make_optimizer",
                      lambda *a: chained.append(with_chain(fused(*a))) or chained[-1])
  one = jax.devices()[:1]
  code, straight, s_straight = train(tmp_path, "chain", *common, devices=one)
  assert code == 0 and chained   # the step ran the chain's update (its one update path)
  import shutil
  shutil.copytree(tmp_path / "chain", tmp_path / "mixed")
  shutil.rmtree(tmp_path / "mixed" / "checkpoints" / "4")
  monkeypatch.setattr(loop_module, "make_optimizer", fused)
  code, rows, s_mixed = train(tmp_path, "mixed", *common, devices=one)
  assert code == 0
  assert [r["loss"] for r in rows[2:]] == [r["loss"] for r in straight[2:]]
  assert [r["grad_norm"] for r in rows[2:]] == [r["grad_norm"] for r in straight[2:]]
  for a, b in zip(jax.tree.leaves(_host(s_straight)), jax.tree.leaves(_host(s_mixed))):
    np.testing.assert_array_equal(a, b)

