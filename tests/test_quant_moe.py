"""Quantized routed experts (MoE, issue 18): the experts' fake-quantized grouped matmul equals a
NumPy reference (per expert and output column) with a straight-through gradient, and their
calibration probe gives each expert's X^T X; int8 QAT of qwen3-moe-tiny trains with 8 devices
(expert parallel) equal to 1; RTN int8 keeps the logits within 1 % and the checkpoint restores
the experts as int8 arrays of a quarter of the float bytes; GPTQ per expert beats RTN per expert
on a trained model, and the int4 checkpoint evaluates, decodes, inspects and exports to
transformers (dequantized) as our integer model computes it."""
import inspect as pyinspect
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from conftest import BASE_YML, MESH_1, train
from MaxText import decode, evaluate, quantize
from MaxText.checkpoint.manager import load_params, load_params_host
from MaxText.config.load import load_config, replace
from MaxText.data.tokenizers import ByteTokenizer
from MaxText.layers import quant
from MaxText.models.model_config import ModelConfig
from MaxText.models.registry import init_params, make_model_def
from MaxText.sharding.mesh import create_mesh
from MaxText.sharding.rules import parse_rules, tree_shardings
from MaxText.train.from_checkpoint import adopt_checkpoint_architecture


# held-in text (the embedded data is the standard library's source) as byte tokens
TEXT = ByteTokenizer().encode(pyinspect.getsource(json.JSONEncoder.iterencode))[:128]
POS = np.broadcast_to(np.arange(64), (2, 64))
SEG = np.ones((2, 64), np.int32)


# ---- the grouped matmul and the probe against NumPy ----------------------------------------------
def test_expert_fake_quant_equals_numpy_and_gradients_pass_straight_through():
  rng = np.random.default_rng(0)
  X, K, N = 3, 16, 6

  def positive_max(a):   # the absmax of each channel (along axis 1) positive: -absmax is a tie
    at = np.take_along_axis(a, np.abs(a).argmax(axis=1)[:, None], axis=1)
    return (a * np.sign(at)).astype(np.float32)

  w = positive_max(rng.normal(size=(X, K, N)) * rng.uniform(0.1, 3, size=(X, 1, N)))
  rows = positive_max(rng.normal(size=(12, K)))
  sizes = np.array([4, 0, 6], np.int32)                 # 10 of 12 rows; expert 1 gets none
  starts = np.cumsum(sizes) - sizes

  def fq(a, axis):   # qwix's symmetric int8: absmax over `axis` maps to 127.5, levels -128..127
    s = np.abs(a).max(axis=axis, keepdims=True) / np.float32(127.5)
    return np.clip(np.round(a / s), -128, 127) * s

  wq, xq = fq(w, 1), fq(rows, 1)                        # per expert + column; per token
  want = np.zeros((12, N), np.float32)
  for e in range(X):
    want[starts[e]:starts[e] + sizes[e]] = xq[starts[e]:starts[e] + sizes[e]] @ wq[e]
  rule = quant.qat_rules("int8", "")[-1]
  dot = quant.ExpertQat(rule).ragged_dot
  got = dot(jnp.asarray(rows), jnp.asarray(w), jnp.asarray(sizes))
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
  assert not np.allclose(np.asarray(got), np.asarray(jax.lax.ragged_dot(rows, w, sizes)),
                         rtol=1e-5, atol=1e-5)
  # straight through: the gradients are the float matmul's, at the original operands
  loss = lambda f: (lambda x, v: jnp.sum(jnp.sin(f(x, v, jnp.asarray(sizes)))))
  g_q = jax.grad(loss(dot), argnums=(0, 1))(jnp.asarray(rows), jnp.asarray(w))
  x_, w_ = jnp.asarray(rows), jnp.asarray(w)
  cot = jnp.cos(got)                                   # d sin(y) / dy at the quantized forward
  _, vjp = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, jnp.asarray(sizes)), x_, w_)
  for a, b in zip(g_q, vjp(cot)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  # the calibration probe: its gradient is each expert's X^T X over the rows routed to it
  probe = jnp.zeros((X, K, K))
  h = jax.grad(lambda p: jnp.sum(quant.ExpertProbe().ragged_dot(
      jnp.asarray(rows), (jnp.asarray(w), p), jnp.asarray(sizes))))(probe)
  for e in range(X):
    r = rows[starts[e]:starts[e] + sizes[e]]
    np.testing.assert_allclose(np.asarray(h[e]), r.T @ r, rtol=1e-5, atol=1e-5)
  assert not np.asarray(h[1]).any()


# ---- quantized training ----------------------------------------------------------------------------
QWEN3_MOE = ["model_name=qwen3-moe-tiny"]


def test_int8_qat_of_the_experts_trains_and_expert_parallel_equals_one_device(tmp_path):
  cfg = load_config([BASE_YML, *QWEN3_MOE])
  params = init_params(ModelConfig.from_config(cfg), 0)
  tokens = jnp.asarray(TEXT[:2 * 32]).reshape(2, 32)

  def forward(exclude):   # attention and the shared projections kept float: the experts only
    mcfg = ModelConfig.from_config(replace(cfg, quantization="int8", quantization_exclude=exclude))
    return np.asarray(make_model_def(mcfg).apply(params, tokens, POS[:, :32], SEG[:, :32]))

  want = forward("attn|experts")
  assert np.array_equal(want, np.asarray(make_model_def(ModelConfig.from_config(cfg)).apply(
      params, tokens, POS[:, :32], SEG[:, :32])))
  assert not np.allclose(forward("attn"), want, rtol=1e-4, atol=1e-4)
  args = [*QWEN3_MOE, "quantization=int8", "quantization_exclude=attn", "steps=8",
          "learning_rate=3e-3", "enable_checkpointing=false"]
  code, one, _ = train(tmp_path, "one", *args, *MESH_1, devices=jax.devices()[:1])
  assert code == 0 and one[-1]["loss"] < one[0]["loss"] - 0.5
  code, eight, _ = train(tmp_path, "eight", *args, "per_device_batch_size=1",
                         "ici_expert_parallelism=4", "ici_fsdp_parallelism=2")
  assert code == 0
  # the experts' weight scales are per expert (the same on any split); activations per token:
  # what differs is the order of fp32 sums, and an int8 level a rounding flips
  np.testing.assert_allclose([r["loss"] for r in eight], [r["loss"] for r in one], rtol=2e-3)

