"""bfloat16 weights (`weight_dtype=bfloat16`): every family trains with them, its parameters and
AdamW moments staying bf16 (`moment_dtype=auto`: the weights' dtype, declared once by the
optimizer, train/optimizer.py), and the first step's loss is the float32 model's loss at the
run's initial parameters (the bf16 values, exactly representable in float32) — the float32 path
is the oracle, evaluated on the run's own first batch. On 8 devices with the moments sharded over
the data axis (ZeRO-1) and kept in float32 (`moment_dtype=float32`, the update gathered in float32
and added to the bf16 weights), a run resumes bit for bit. The fused update's mixed dtypes against
optax's chain: tests/test_fused_adamw.py."""
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import MESH_1, MESH_222, TINY, argv, read_metrics
from MaxText.losses.token_loss import token_loss_sums
from MaxText.models.registry import init_params
from MaxText.sharding.rules import use_rules
from MaxText.train import loop
from MaxText.train.state import trained

# the families' tiny model files (TINY's run settings, not its model shape), Gemma 4's cut from 10
# layers (two blocks of 5, compiled 10 times) to a full layer and a full layer on its K/V with the
# double-wide MLP, Gemma 4 MoE's to a sliding and a full layer; 2 steps
# of 4 rows of 32 tokens: the second step runs from the state the first returned (the state a
# compiled step is called with, whose dtypes once differed from those it was compiled for)
RUN = [a for a in TINY if a.split("=")[0] not in (
    "emb_dim", "num_decoder_layers", "num_query_heads", "num_kv_heads", "head_dim", "mlp_dim",
    "vocab_size")] + ["steps=2", "max_target_length=32", "per_device_batch_size=4",
                      "enable_checkpointing=false", "weight_dtype=bfloat16"]
# Qwen3's dense model is not a case of its own: its layers are llama's (this file's "llama" trains
# the dense MLP in bf16) with q/k norms, which "qwen3-moe" trains in bf16 (use_qk_norm=true there
# too); "qwen3-lora" runs qwen3-tiny itself, its base frozen in bf16 under bf16 adapters
FAMILIES = {
    "llama": (),
    "qwen3-moe": ("model_name=qwen3-moe-tiny",),
    # a full layer, then a full layer on its K/V with the double-wide MLP: the sliding kind's
    # layer trains in bf16 as gemma4-moe's below (the same gemma4 decoder block)
    "gemma4": ("model_name=gemma4-tiny", "num_decoder_layers=2", "attention_pattern=f",
               "num_kv_shared_layers=1"),
    # one layer of each kind (the tiny files' 6 and 4 layers repeat the sliding and the linear
    # kind, each a program part of its own: ~4 CPU s more a family and no code path more)
    "gemma4-moe": ("model_name=gemma4-moe-tiny", "num_decoder_layers=2", "attention_pattern=sf"),
    "qwen3-next": ("model_name=qwen3-next-tiny", "num_decoder_layers=2", "attention_pattern=lf",
                   "linear_chunk_size=16"),
    "qwen3-lora": ("model_name=qwen3-tiny", "lora_rank=4"),   # the adapters (and moments) bf16
}


def _host(tree):
  return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


def _dtypes(tree):
  return {jnp.dtype(x.dtype).name for x in jax.tree.leaves(tree)}


def _oracle_first_loss(out, name, over, bf16_trainer):
  """The first step's loss by the float32 model (weight_dtype=float32, a trainer built but not
  run) at the bf16 run's initial parameters, on the run's first batch."""
  f32 = loop.build(argv(out, f"{name}-f32", *over, *MESH_1, model=[*RUN, "weight_dtype=float32"]),
                   jax.devices()[:1])
  assert _dtypes(f32.abstract["params"]) == {"float32"}
  start = init_params(bf16_trainer.mcfg, bf16_trainer.cfg.seed)   # the run's (its one program)
  params = jax.device_put(jax.tree.map(lambda x: x.astype(np.float32), _host(start)),
                          f32.shardings["params"])
  data = f32.open_data(None)
  batch = f32.device_batch(next(data))
  data.close()
  cfg = f32.cfg

  @jax.jit
  def loss(params, batch):
    with use_rules(f32.mesh, f32.rules):
      nll, _, n, aux = token_loss_sums(f32.model_def, params, batch,
                                       z_loss_weight=cfg.z_loss_weight,
                                       chunk=cfg.loss_chunk_length)
      if f32.aux_terms is not None:
        nll = nll + f32.aux_terms.loss(aux)[0]
    return nll / jnp.maximum(n, 1.0)

  return float(loss(params, batch))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_trains_with_bf16_weights(tmp_path, family):
  over = FAMILIES[family]
  code, trainer = loop.run(argv(tmp_path, family, *over, *MESH_1, model=RUN),
                           devices=jax.devices()[:1])
  assert code == 0
  rows = read_metrics(os.path.join(tmp_path, family))
  losses = [r["loss"] for r in rows]
  assert len(losses) == 2 and np.all(np.isfinite(losses)), losses
  state = trainer.final_state
  assert _dtypes(state["params"]) == {"bfloat16"}
  moments = [x for x in jax.tree.leaves(state["opt_state"]) if x.ndim]
  assert moments and _dtypes(moments) == {"bfloat16"}
  start = _host(init_params(trainer.mcfg, trainer.cfg.seed))
  moved = trained(_host(state["params"]), trainer.adapters_only)
  assert any(not np.array_equal(a, b) for a, b in
             zip(jax.tree.leaves(moved), jax.tree.leaves(trained(start, trainer.adapters_only))))
  # the first loss is the float32 model's at the same (bf16) values: only the programs differ
  want = _oracle_first_loss(tmp_path, family, over, trainer)
  np.testing.assert_allclose(losses[0], want, rtol=2e-6)


RESUME = ("steps=4", "checkpoint_period=2", "max_checkpoints_to_keep=3", "weight_dtype=bfloat16",
          "moment_dtype=float32", *MESH_222)


def test_bf16_weights_float32_moments_zero1_resume_bitwise(tmp_path):
  code, straight = loop.run(argv(tmp_path, "straight", *RESUME))
  assert code == 0 and straight.tx.shard_over_data   # the moments over the data axis too
  state = straight.final_state
  assert _dtypes(state["params"]) == {"bfloat16"}
  assert _dtypes([x for x in jax.tree.leaves(state["opt_state"]) if x.ndim]) == {"float32"}
  shutil.copytree(tmp_path / "straight", tmp_path / "resumed")
  shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "4")
  code, resumed = loop.run(argv(tmp_path, "resumed", *RESUME))
  assert code == 0
  rows, again = (read_metrics(os.path.join(tmp_path, n)) for n in ("straight", "resumed"))
  assert [r["loss"] for r in again[2:]] == [r["loss"] for r in rows[2:]]
  assert [r["grad_norm"] for r in again[2:]] == [r["grad_norm"] for r in rows[2:]]
  for a, b in zip(jax.tree.leaves(_host(state)), jax.tree.leaves(_host(resumed.final_state))):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(a, b)
