"""The activation part of the memory pre-flight (`train/memory.py: activation_bytes`): it follows
the remat policy, the rows, the sequence and the loss chunk, stays close to XLA's own count of the
compiled step's buffers, and a run whose activations cannot fit is refused before compiling."""
import jax
import pytest

from conftest import MESH_1, argv
from MaxText.config.load import load_config
from MaxText.train import memory
from MaxText.train.loop import Trainer, run

MODEL = ("emb_dim=128", "num_decoder_layers=3", "num_query_heads=4", "num_kv_heads=2",
         "head_dim=32", "mlp_dim=384", "vocab_size=4096", "max_target_length=128",
         "per_device_batch_size=4", "loss_chunk_length=0", *MESH_1)


def trainer(tmp_path, *overrides):
  return Trainer(load_config(argv(tmp_path, "m", *MODEL, *overrides)), jax.devices()[:1])


def estimate(t):
  act = memory.activation_bytes(t.mcfg, rows=t.rows_per_device(), seq=t.cfg.max_target_length,
                                loss_chunk=t.cfg.loss_chunk_length)
  return act, memory.estimate(t.abstract, t.devices, act)


def test_activation_estimate_follows_the_settings(tmp_path):
  acts = {p: estimate(trainer(tmp_path, f"remat_policy={p}"))[0] for p in ("none", "save_matmuls", "full")}
  assert acts["none"] > acts["save_matmuls"] > acts["full"] > 0
  base = estimate(trainer(tmp_path))[0]
  assert estimate(trainer(tmp_path, "per_device_batch_size=8"))[0] == pytest.approx(2 * base, rel=1e-6)
  # the whole sequence's two fp32 logit copies outweigh the layers' backward working set, one
  # chunk's do not (the larger of the two counts; tests/test_memory_plan.py: the chip's figures)
  assert estimate(trainer(tmp_path, "loss_chunk_length=16"))[0] < base


@pytest.mark.parametrize("overrides", [(), ("remat_policy=full",), ("dtype=bfloat16",),
                                       ("loss_chunk_length=32",)])
def test_estimate_is_close_to_xla_count(tmp_path, overrides):
  t = trainer(tmp_path, *overrides)
  _, est = estimate(t)
  xla = memory.compiled_step_bytes(t.compile_step())
  assert xla is not None
  ratio = (est.needed - est.runtime) / xla
  assert 0.7 < ratio < 1.6, (ratio, est, xla)


def test_activations_that_cannot_fit_are_refused_before_compiling(tmp_path, capsys):
  t = trainer(tmp_path)
  available, _ = memory.available_bytes_per_device(t.devices)
  act_per_row = estimate(t)[0] / t.rows_per_device()
  rows = int(2 * available / act_per_row)          # activations of twice the memory there is
  code, _ = run(argv(tmp_path, "big", *MODEL, f"per_device_batch_size={rows}",
                     "dataset_type=synthetic"), devices=jax.devices()[:1])
  err = capsys.readouterr().err
  assert code == 2, err[-2000:]
  assert "does not fit" in err and "activations ~" in err and "per_device_batch_size" in err
