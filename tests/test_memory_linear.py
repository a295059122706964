"""The memory pre-flight's Gated DeltaNet term (models/qwen3_next/family.py: linear_layer_bytes):
the estimate of Qwen3-Next's TPU family rows within the error margin of XLA's count for a v5e
(benchmarks/tpu_aot.py, libtpu's deviceless compile, which matched the chip to the byte), and the
term following the dimensions it is derived from. Arithmetic on abstract states (no compile)."""
import dataclasses

import jax
import pytest

from conftest import BASE_YML, MESH_1
from MaxText.config.load import load_config
from MaxText.models.qwen3_next.family import linear_layer_bytes
from MaxText.train import memory
from MaxText.train.loop import Trainer

GiB = 2**30
TPU_LIMIT = 15.75 * GiB   # one v5e's bytes_limit
# benchmarks/tpu_family_rows.py's next2k / next8k (keys ... ours) + dataset_type=synthetic
NEXT = ("model_name=qwen3-next-80b-a3b", "num_decoder_layers=4", "num_experts=16",
        "num_experts_per_tok=10", "vocab_size=32768", "remat_policy=full", "weight_dtype=float32",
        "moe_aux_loss_weight=0.001", "linear_chunk_size=64", "flash_block_q=1024",
        "flash_block_kv=1024", "dtype=bfloat16", "attention=flash", "flash_fused_bwd=true",
        "dataset_type=synthetic")
# (max_target_length, per_device_batch_size, XLA's compiled_step_bytes + the accelerator's runtime
# allowance in GiB: `bash benchmarks/tpu_aot.sh --base "<NEXT>" --variant ...`, with the routed
# copies laid out copy-major (moe.copy_major; at 26394e6, [T, k, D]: 14.08 / 13.84)
XLA_V5E = [(2048, 4, 13.36), (8192, 1, 13.37)]


def trainer(tmp_path, *overrides) -> Trainer:
  cfg = load_config([BASE_YML, *NEXT, *MESH_1, f"base_output_directory={tmp_path}", *overrides])
  return Trainer(cfg, jax.devices()[:1])


@pytest.mark.parametrize("seq,batch,xla", XLA_V5E)
def test_qwen3_next_rows_within_the_margin_of_xla(tmp_path, seq, batch, xla):
  t = trainer(tmp_path, f"max_target_length={seq}", f"per_device_batch_size={batch}")
  est = dataclasses.replace(t.memory_estimate(), available=int(TPU_LIMIT),
                            runtime=memory.RUNTIME_ALLOWANCE_ACCELERATOR, platform="tpu")
  assert abs(est.needed / GiB - xla) <= memory.ERROR_MARGIN * xla, (est.needed / GiB, xla)


def test_linear_term_follows_its_dimensions(tmp_path):
  mcfg = trainer(tmp_path, "max_target_length=2048", "per_device_batch_size=4").mcfg
  base = linear_layer_bytes(mcfg, 4, 2048)
  assert linear_layer_bytes(mcfg, 8, 2048) == 2 * base            # linear in the tokens
  assert linear_layer_bytes(mcfg, 1, 8192) == base                # chunked: not in S²
  assert linear_layer_bytes(mcfg, 4, 2000) == base                # padded to whole chunks
  wider = dataclasses.replace(mcfg, linear_num_value_heads=64)
  assert linear_layer_bytes(wider, 4, 2048) > 1.5 * base           # value-head arrays dominate
  # every linear layer's (3 of "lllf") with nothing recomputed, else the one being differentiated
  assert linear_layer_bytes(dataclasses.replace(mcfg, remat_policy="none"), 4, 2048) == 3 * base
  assert linear_layer_bytes(dataclasses.replace(mcfg, attention_pattern="f"), 4, 2048) == 0
