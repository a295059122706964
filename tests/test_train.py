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


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
  """10 steps on one device (TINY's defaults): (metrics rows, final state)."""
  code, rows, state = train(tmp_path_factory.mktemp("one"), "one", *MESH_1,
                            "enable_checkpointing=false", devices=jax.devices()[:1])
  assert code == 0
  return rows, state


def test_loss_falls_on_default_data(one_device):
  m, _ = one_device
  first, last = np.mean([r["loss"] for r in m[:3]]), np.mean([r["loss"] for r in m[-5:]])
  assert last < first - 1.5, (first, last)
  for key in ("step", "loss", "lr", "grad_norm", "step_time_s", "tokens_per_s",
              "tflops_per_device", "mfu"):
    assert key in m[-1]


# 10 steps on 8 devices (data 2 x fsdp 2 x tensor 2) with checkpoints at 5 and 10: the 8-device
# side of the mesh-invariance test, and the run the resume, the rerun and the restores start from
# (one program: the steps, not the checkpoints, are in the compiled step)
RESUME = ("steps=10", "checkpoint_period=5", "max_checkpoints_to_keep=5", *MESH_222)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """An 8-device run of 10 steps with checkpoints at 5 and 10: (output folder, metrics rows,
  final state)."""
  out = tmp_path_factory.mktemp("straight")
  code, rows, state = train(out, "straight", *RESUME)
  assert code == 0
  return out, rows, state


def test_one_device_equals_eight_devices(one_device, straight):
  (m1, s1), (_, m8, s8) = one_device, straight
  assert [m["step"] for m in m1] == [m["step"] for m in m8] == list(range(1, 11))
  l1, l8 = np.array([m["loss"] for m in m1]), np.array([m["loss"] for m in m8])
  np.testing.assert_allclose(l8, l1, rtol=0, atol=1e-5)
  # the 8-device parameters really are split over the mesh
  q = s8["params"]["decoder"]["runs"][0][0]["attn"]["query"]["kernel"]
  assert q.sharding.shard_shape(q.shape) != q.shape
  for a, b in zip(jax.tree.leaves(_host(s1["params"])), jax.tree.leaves(_host(s8["params"]))):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def test_resume_is_bitwise(straight):
  out, straight_rows, s_straight = straight
  # the same run, "interrupted" after step 5 (the run is deterministic: a copy of its folder
  # without the step-10 checkpoint); the resumed run moves the rows after 5 to
  # metrics.superseded.jsonl and writes them anew (one row per step)
  shutil.copytree(out / "straight", out / "resumed")
  ckpt = out / "resumed" / "checkpoints"
  assert sorted(os.listdir(ckpt), key=int) == ["5", "10"]
  shutil.rmtree(ckpt / "10")
  code, rows, s_resumed = train(out, "resumed", *RESUME)
  assert code == 0
  assert [r["step"] for r in rows] == list(range(1, 11))
  assert os.path.exists(out / "resumed" / "metrics.superseded.jsonl")
  resumed = rows[5:]
  assert [r["loss"] for r in resumed] == [r["loss"] for r in straight_rows[5:]]
  assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in straight_rows[5:]]
  # the smoothed loss continues across the resume (the kept rows' losses replayed)
  assert [r["loss_smoothed"] for r in resumed] == [r["loss_smoothed"] for r in straight_rows[5:]]
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
    cfg = load_config(argv(out, "straight", "steps=10", *mesh))
    trainer = Trainer(cfg)
    ckpts = RunCheckpoints(str(out / "straight" / "checkpoints"), max_to_keep=5, async_save=False)
    state, meta = ckpts.restore(10, trainer.abstract, None)
    ckpts.close()
    assert meta["step"] == 10
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(trainer.shardings)):
      assert a.sharding == b
    for a, b in zip(jax.tree.leaves(_host(saved)), jax.tree.leaves(_host(state))):
      np.testing.assert_array_equal(a, b)
  # parameters-only load (fine-tuning) from the same directory
  params = load_params(str(out / "straight" / "checkpoints"), trainer.abstract["params"])
  for a, b in zip(jax.tree.leaves(_host(saved["params"])), jax.tree.leaves(_host(params))):
    np.testing.assert_array_equal(a, b)


PLAIN = ("steps=3", "enable_checkpointing=false", "scan_layers=false")
# the 8-device layout of PLAIN's 8-row batch: two accumulated micro-batches of 4 rows over
# (data 2, fsdp 2, tensor 2), one row per batch shard
EIGHT_GA = (*MESH_222, "per_device_batch_size=0.5", "gradient_accumulation_steps=2")


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
  """The metrics rows of 3 plain steps on one device (unscanned): the variants' reference."""
  code, rows, _ = train(tmp_path_factory.mktemp("plain"), "ref", *PLAIN, *MESH_1,
                        devices=jax.devices()[:1])
  assert code == 0
  return rows


@pytest.fixture(scope="module")
def eight_ga_run(tmp_path_factory):
  """The metrics rows of PLAIN's 3 steps on 8 devices with two accumulated micro-batches."""
  code, rows, _ = train(tmp_path_factory.mktemp("eight_ga"), "ga", *PLAIN, *EIGHT_GA)
  assert code == 0
  return rows


def test_variants_match_plain_run(tmp_path, plain_run):
  """Remat changes memory/scheduling, not the math: remat_policy=full against the plain run's
  save_matmuls (base.yml's default). Gradient accumulation, the other variant, is the next test's
  8-device run (the one accumulation path of train/step.py, there inside the sharded step; a
  1-device run of it compiled one more step program that took no other code path)."""
  ref = plain_run
  _, got, _ = train(tmp_path, "var", *PLAIN, *MESH_1, "remat_policy=full",
                    devices=jax.devices()[:1])
  np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in ref], rtol=0, atol=1e-5)


def test_gradient_accumulation_on_eight_devices_matches_one_device(plain_run, eight_ga_run):
  """2 micro-batches of 4 rows over (data 2, fsdp 2, tensor 2) = one 8-row batch on 1 device."""
  assert len(eight_ga_run) == len(plain_run) == 3
  np.testing.assert_allclose([r["loss"] for r in eight_ga_run], [r["loss"] for r in plain_run],
                             rtol=0, atol=1e-5)


def test_flash_attention_trains_like_dot_product(tmp_path, eight_ga_run):
  """attention=flash (Pallas kernel, interpret mode on CPU) gives the losses of the XLA path
  (attention=autoselected: dot_product on a CPU) inside the sharded step (shard_map over batch and
  heads, each accumulated micro-batch) on 8 devices (which the test above holds to the 1-device
  plain run's). A train step always runs under its mesh, so a 1-device run took the same path
  (layers/attention_ops.py _per_shard: shard_map over a 1-device mesh) with one more program to
  compile; the kernel alone against dot_product over shapes, blocks and options:
  tests/test_flash_attention.py."""
  flash = ("attention=flash", "flash_block_q=32", "flash_block_kv=32")
  _, got, _ = train(tmp_path, "flash", *PLAIN, *EIGHT_GA, *flash)
  assert len(got) == 3
  np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in eight_ga_run], rtol=0,
                             atol=1e-5)
