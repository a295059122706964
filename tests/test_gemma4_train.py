"""Training the gemma4 family: 1 device with the XLA attention equals 8 (data 2, fsdp 2, tensor 2 —
the full layers' single kv head cannot split over tensor and stays whole) with the flash kernel
(sliding windows, K = V, shared K/V) inside the sharded step, and the frozen layer scalars never
move."""
import jax
import numpy as np

from conftest import MESH_1, MESH_222, train

# 3 layers (s f f; the last reuses the K/V of layer 1 — Gemma 4's last layer is full), 3 steps:
# every feature once (sliding window, K = V on the full layer, the shared K/V handed on inside the
# sharded flash step, the shared layer's double-wide MLP). A fourth, sliding shared layer would be
# the same hand-on again, at a quarter more of both programs (tests/test_context_parallel.py's
# Gemma 4 is the last two of them: the sliding kind under context parallelism is its op's test).
GEMMA = ("model_name=gemma4-tiny", "num_decoder_layers=3", "attention_pattern=sff",
         "num_kv_shared_layers=1", "sliding_window=16", "steps=3", "enable_checkpointing=false",
         "flash_block_q=32", "flash_block_kv=32", "learning_rate=3e-4")
# Gemma's attention scale 1.0 on normalised q, k gives large logits, so fp32 rounding differs
# between the kernels by ~2e-5 relative in the gradients; at the default 3e-3 learning rate AdamW
# amplifies that to ~2e-4 by step 5. At 3e-4 the runs stay within the 1e-5.


def test_gemma4_mesh_invariance_flash_and_frozen_scalars(tmp_path):
  """One device with the XLA attention against 8 devices (data 2, fsdp 2, tensor 2) with the flash
  kernel: the same losses (mesh invariance and the kernel at once; tests/test_train.py and
  tests/test_flash_attention.py check each alone), the frozen layer scalars never move."""
  code1, one, s1 = train(tmp_path, "one", *GEMMA, *MESH_1, "attention=dot_product",
                         devices=jax.devices()[:1])
  codef, flash, s8 = train(tmp_path, "flash", *GEMMA, *MESH_222, "attention=flash")
  assert code1 == codef == 0
  loss = lambda rows: np.array([r["loss"] for r in rows])
  assert len(loss(one)) == 3 and loss(one)[-1] < loss(one)[0]
  np.testing.assert_allclose(loss(flash), loss(one), rtol=0, atol=1e-5)
  members = s8["params"]["decoder"]["runs"][0]
  q_full = members[1]["attn"]["query"]["kernel"]
  assert q_full.sharding.shard_shape(q_full.shape) != q_full.shape      # really sharded
  scalars = [np.asarray(jax.device_get(m["layer_scalar"]))
             for run in s1["params"]["decoder"]["runs"].values() for m in run.values()]
  assert len(scalars) == 3 and all(np.array_equal(s, np.ones_like(s)) for s in scalars)
  moved = np.asarray(jax.device_get(s1["params"]["decoder"]["runs"][0][0]["attn_norm"]["scale"]))
  assert not np.array_equal(moved, np.ones_like(moved))                 # trainable ones did move
