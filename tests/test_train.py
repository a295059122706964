"""End-to-end training on a tiny model: mesh invariance, loss falling, bitwise resume,
restore onto another mesh."""
import os
import shutil

import jax
import numpy as np
import pytest

from conftest import MESH_1, MESH_222, train


def _host(tree):
  return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


def test_one_device_equals_eight_devices(tmp_path):
  code1, m1, s1 = train(tmp_path, "one", *MESH_1, "enable_checkpointing=false",
                        devices=jax.devices()[:1])
  code8, m8, s8 = train(tmp_path, "eight", *MESH_222, "enable_checkpointing=false")
  assert code1 == code8 == 0
  assert [m["step"] for m in m1] == list(range(1, 11))
  l1, l8 = np.array([m["loss"] for m in m1]), np.array([m["loss"] for m in m8])
  np.testing.assert_allclose(l8, l1, rtol=0, atol=1e-5)
  # the 8-device parameters really are split over the mesh
  q = s8["params"]["decoder"]["runs"][0][0]["attn"]["query"]["kernel"]
  assert q.sharding.shard_shape(q.shape) != q.shape
  for a, b in zip(jax.tree.leaves(_host(s1["params"])), jax.tree.leaves(_host(s8["params"]))):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def test_loss_falls_on_default_data(tmp_path):
  code, m, _ = train(tmp_path, "falls", "steps=40", "warmup_steps=5", "learning_rate=1e-2",
                     "enable_checkpointing=false", *MESH_1, devices=jax.devices()[:1])
  assert code == 0
  first, last = np.mean([r["loss"] for r in m[:3]]), np.mean([r["loss"] for r in m[-5:]])
  assert last < first - 1.5, (first, last)
  for key in ("step", "loss", "lr", "grad_norm", "step_time_s", "tokens_per_s",
              "tflops_per_device", "mfu"):
    assert key in m[-1]


RESUME = ("steps=20", "checkpoint_period=10", "max_checkpoints_to_keep=5", *MESH_222)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """An 8-device run of 20 steps with checkpoints at 10 and 20: (output folder, metrics rows,
  final state). The resume and the restore onto other meshes both start from it."""
  out = tmp_path_factory.mktemp("straight")
  code, rows, state = train(out, "straight", *RESUME)
  assert code == 0
  return out, rows, state


def test_resume_is_bitwise(straight):
  out, straight_rows, s_straight = straight
  # the same run, "interrupted" after step 10 (the run is deterministic: a copy of its folder
  # without the step-20 checkpoint); the resumed run moves the rows after 10 to
  # metrics.superseded.jsonl and writes them anew (one row per step)
  shutil.copytree(out / "straight", out / "resumed")
  ckpt = out / "resumed" / "checkpoints"
  assert sorted(os.listdir(ckpt)) == ["10", "20"]
  shutil.rmtree(ckpt / "20")
  code, rows, s_resumed = train(out, "resumed", *RESUME)
  assert code == 0
  assert [r["step"] for r in rows] == list(range(1, 21))
  assert os.path.exists(out / "resumed" / "metrics.superseded.jsonl")
  resumed = rows[10:]
  assert [r["loss"] for r in resumed] == [r["loss"] for r in straight_rows[10:]]
  assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in straight_rows[10:]]
  # the smoothed loss continues across the resume (the kept rows' losses replayed)
  assert [r["loss_smoothed"] for r in resumed] == [r["loss_smoothed"] for r in straight_rows[10:]]
  for a, b in zip(jax.tree.leaves(_host(s_straight)), jax.tree.leaves(_host(s_resumed))):
    np.testing.assert_array_equal(a, b)


def test_rerun_of_finished_run_does_nothing(straight):
  out, straight_rows, _ = straight   # finished: its last checkpoint is its last step
  code, rows, state = train(out, "straight", *RESUME)
  assert code == 0 and state is None
  assert rows == straight_rows            # its metrics as they were


def test_restore_onto_different_mesh_is_exact(straight):
  from MaxText.checkpoint.manager import RunCheckpoints, load_params
  from MaxText.config.load import load_config
  from MaxText.train.loop import Trainer
  from conftest import argv
  out, _, saved = straight   # saved on data 2 x fsdp 2 x tensor 2
  for mesh in (["ici_fsdp_parallelism=8"], ["ici_tensor_parallelism=4", "ici_fsdp_parallelism=2"]):
    cfg = load_config(argv(out, "straight", "steps=20", *mesh))
    trainer = Trainer(cfg)
    ckpts = RunCheckpoints(str(out / "straight" / "checkpoints"), max_to_keep=5, async_save=False)
    state, meta = ckpts.restore(20, trainer.abstract, None)
    ckpts.close()
    assert meta["step"] == 20
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(trainer.shardings)):
      assert a.sharding == b
    for a, b in zip(jax.tree.leaves(_host(saved)), jax.tree.leaves(_host(state))):
      np.testing.assert_array_equal(a, b)
  # parameters-only load (fine-tuning) from the same directory
  params = load_params(str(out / "straight" / "checkpoints"), trainer.abstract["params"])
  for a, b in zip(jax.tree.leaves(_host(saved["params"])), jax.tree.leaves(_host(params))):
    np.testing.assert_array_equal(a, b)


PLAIN = ("steps=3", "enable_checkpointing=false", "scan_layers=false", *MESH_1)


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
  """The metrics rows of 3 plain steps on one device (unscanned): the variants' reference."""
  code, rows, _ = train(tmp_path_factory.mktemp("plain"), "ref", *PLAIN, devices=jax.devices()[:1])
  assert code == 0
  return rows


@pytest.mark.parametrize("extra", [["scan_layers=false", "remat_policy=full"],
                                   ["remat_policy=save_matmuls", "gradient_accumulation_steps=2",
                                    "per_device_batch_size=4"]])
def test_variants_match_plain_run(tmp_path, plain_run, extra):
  """Remat and gradient accumulation change memory/scheduling, not the math."""
  ref = plain_run
  _, got, _ = train(tmp_path, "var", *PLAIN, *extra, devices=jax.devices()[:1])
  np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in ref], rtol=0, atol=1e-5)


def test_gradient_accumulation_on_eight_devices_matches_one_device(tmp_path):
  """2 micro-batches of 8 rows over (data 2, fsdp 2, tensor 2) = one 16-row batch on 1 device."""
  base = ("steps=3", "enable_checkpointing=false")
  _, ref, _ = train(tmp_path, "ref", *base, *MESH_1, "per_device_batch_size=16",
                    devices=jax.devices()[:1])
  _, got, _ = train(tmp_path, "ga", *base, *MESH_222, "gradient_accumulation_steps=2")
  np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in ref], rtol=0, atol=1e-5)


@pytest.mark.parametrize("mesh", ["one", "eight"])
def test_flash_attention_trains_like_dot_product(tmp_path, mesh):
  """attention=flash (Pallas kernel, interpret mode on CPU) gives the losses of the XLA path, on
  one device and inside the sharded step (shard_map over batch and heads) on 8 devices."""
  base = ("steps=5", "enable_checkpointing=false", "flash_block_q=32", "flash_block_kv=32")
  where = dict(devices=jax.devices()[:1]) if mesh == "one" else {}
  layout = MESH_1 if mesh == "one" else MESH_222
  _, ref, _ = train(tmp_path, "xla", *base, *layout, "attention=dot_product", **where)
  _, got, _ = train(tmp_path, "flash", *base, *layout, "attention=flash", **where)
  assert len(got) == 5
  np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in ref], rtol=0, atol=1e-5)
