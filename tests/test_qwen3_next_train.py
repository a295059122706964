"""Training the qwen3_next family: 3 steps on 1 device equal 3 on 8 (fsdp 2, expert 2, tensor 2:
the batch over fsdp and expert, the experts over expert, the DeltaNet and attention heads over
tensor — one run for both, one compile fewer); the carried MTP block never moves (bit for bit, signed zeros included); a
recurrent state that cannot fit is refused before anything compiles (context parallelism:
tests/test_context_parallel.py)."""
import jax
import numpy as np

from conftest import BASE_YML, MESH_1, argv, train
from MaxText.config.load import load_config
from MaxText.models.model_config import ModelConfig
from MaxText.models.registry import get_family, init_params
from MaxText.train import memory

# Every expert on every token (top-k = E = 8) and a 3e-4 learning rate: Gated DeltaNet layers
# amplify fp32 rounding far more than attention (their output RMSNorm divides outputs near zero by
# up to 1/sqrt(eps)), so on 8 devices the hidden states differ from 1 device by ~1e-7 relative;
# with top-2 routing that flips near-tie expert choices (a discrete change, not a sharding error),
# and at the default 3e-3 AdamW turns the rest into ~1e-4 by step 5. The dispatch, the all-to-all
# and the experts' math are exercised all the same.
# 3 steps (warmup 2: learning rates 0, 1.5e-4, 3e-4): two updates, the second from parameters the
# first moved, and step 3's loss after one of them (a step is seconds of CPU here; a sharding error
# shows in step 1's loss, the first update's parameters and step 2's gradients already).
# Layers [linear, full]: one layer of each kind in one scanned block (a scan of length 1: the
# stacked layer axis and the per-kind shardings are the same as for [linear, full] x 2; a second
# repeat ran the same two layers again, ~15% more of this file's CPU for no new path).
# 4 rows of 32 tokens (2 chunks of 16: the recurrent state still crosses a chunk boundary): one
# row per batch shard on 8 devices (fsdp 2 x expert 2); a step of 8 rows of 64 cost ~4x the CPU
# (most of this file's execution time, on the 8-device run's 8 fake devices).
QWEN3_NEXT = ("model_name=qwen3-next-tiny", "num_decoder_layers=2", "attention_pattern=lf",
              "steps=3", "enable_checkpointing=false", "mtp_num_layers=1", "linear_chunk_size=16",
              "moe_aux_loss_weight=0.01", "num_experts_per_tok=8", "learning_rate=3e-4",
              "max_target_length=32")
MESH_1_ROWS = [*MESH_1, "per_device_batch_size=4"]
MESH_FET = ["per_device_batch_size=0.5", "ici_fsdp_parallelism=2", "ici_expert_parallelism=2",
            "ici_tensor_parallelism=2"]


def _host(tree):
  return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


def test_one_device_equals_eight_and_mtp_stays_frozen(tmp_path):
  code1, one, s1 = train(tmp_path, "one", *QWEN3_NEXT, *MESH_1_ROWS, devices=jax.devices()[:1])
  code8, eight, s8 = train(tmp_path, "eight", *QWEN3_NEXT, *MESH_FET)
  assert code1 == code8 == 0
  loss = lambda rows: np.array([r["loss"] for r in rows])
  # (no "the loss went down": 3 steps on 3 batches at learning rates <= 3e-4 move the loss less
  # than the batches differ; that the steps train is the linear layer's parameters moved, below)
  assert len(loss(one)) == 3 and np.isfinite(loss(one)).all()
  np.testing.assert_allclose(loss(eight), loss(one), rtol=0, atol=1e-5)
  assert one[-1]["moe_aux_loss"] > 0
  linear = s8["params"]["decoder"]["runs"][0][0]["linear_attn"]["in_proj_qkvz"]["kernel"]
  assert linear.sharding.shard_shape(linear.shape)[2] == linear.shape[2] // 2   # key heads / 2
  experts = s8["params"]["decoder"]["runs"][0][0]["mlp"]["experts"]["wo"]
  assert experts.sharding.shard_shape(experts.shape)[1] == experts.shape[1] // 2   # experts / 2
  trained = _host(s1["params"])
  for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(_host(s8["params"]))):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
  mcfg = ModelConfig.from_config(load_config(argv(tmp_path, "one", *QWEN3_NEXT, *MESH_1_ROWS)))
  initial = init_params(mcfg, 0)      # the values the trainer creates (one jitted program)
  moved = trained["decoder"]["runs"][0][0]["linear_attn"]["A_log"]
  assert not np.array_equal(moved, np.asarray(initial["decoder"]["runs"][0][0]["linear_attn"]
                                                                         ["A_log"]))
  for got, want in zip(jax.tree.leaves(trained["mtp"]), jax.tree.leaves(initial["mtp"])):
    assert np.asarray(got).tobytes() == np.asarray(want).tobytes()


def test_preflight_counts_the_recurrent_state():
  """A linear layer's chunked-rule arrays kept for its backward (family.py: linear_layer_bytes),
  the delta-rule states among them (one [Hv, Dk, Dv] fp32 per chunk and sequence), for one layer
  under remat, for every linear layer without."""
  cfg = load_config([BASE_YML, "model_name=qwen3-next-80b-a3b",
                     "max_target_length=4096"])
  family = get_family("qwen3_next")
  mcfg = ModelConfig.from_config(cfg)
  states = 32 * 128 * 128 // 64                                    # values per token
  # Hk 16, Hv 32, Dk = Dv = 128, C 64, X = 2·128 + 2·128: conv out + SiLU, q k v twice, rhs and
  # u|w, the scan's inputs, five C x C matrices, the states; the projection q|k|v|z|b|a (compute dtype: fp32 here)
  fp32 = 2 * 16 * 512 + 2 * 32 * 384 + 2 * 32 * 256 + 32 * 512 + 5 * 32 * 64 + states
  per_layer = 4096 * (fp32 + 16 * 768 + 64) * 4                    # 1.6 GiB a sequence (fp32)
  assert family.activation_bytes(mcfg, 2, 4096) == 2 * per_layer
  assert 2 * per_layer > 2 * 4096 * states * 4                     # the states are a part
  no_remat = ModelConfig.from_config(load_config([BASE_YML,
                                                  "model_name=qwen3-next-80b-a3b",
                                                  "remat_policy=none"]))
  assert family.activation_bytes(no_remat, 2, 4096) == 36 * 2 * per_layer
  est = memory.MemoryEstimate(params=1, grads=1, optimizer=2, available=10, source="test",
                              activations=6 * per_layer)
  assert "activations ~9.57 GiB" in memory.check_fits(est)
