"""Multi-token prediction (MaxText/layers/mtp.py, MaxText/losses/mtp.py): the MTP loss of packed
rows equals a NumPy reference (the shift, the document masks, the [embedding | hidden]
projection, the norms, the shared head, the per-depth sums and the step's scaling), whole and
chunked; gradients reach the MTP block and through it the embedding; a training run logs
`mtp_loss` and moves the block; a family without MTP, or a scale without depths, is refused
(exit 2 naming the key).

The reference runs the MTP depth's decoder layer through the model's own module (the decoder layer
is the one the family's Hugging Face parity tests check); everything around it is NumPy."""
from __future__ import annotations

from functools import partial

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import BASE_YML, MESH_1, train
from MaxText.config.load import load_config
from MaxText.losses.mtp import MTPTerms
from MaxText.losses.token_loss import token_loss_sums
from MaxText.models.model_config import ModelConfig
from MaxText.models.registry import init_params, make_model_def

TINY = ("dtype=float32", "weight_dtype=float32", "emb_dim=32", "num_decoder_layers=2",
        "num_query_heads=2", "num_kv_heads=1", "head_dim=16", "mlp_dim=64", "vocab_size=50",
        "mtp_num_layers=2", "mtp_loss_scale=0.5")
B, S = 2, 16


@pytest.fixture(scope="module")
def model():
  mcfg = ModelConfig.from_config(load_config([BASE_YML, *TINY]))
  params = jax.tree.map(np.asarray, init_params(mcfg, 0))
  # norm scales away from 1, so a swapped norm would show
  rng = np.random.RandomState(1)
  for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
    params["mtp"][name]["scale"] = (1 + 0.3 * rng.randn(mcfg.emb_dim)).astype(np.float32)
  return mcfg, make_model_def(mcfg), params


def packed_batch():
  """Row 0: documents of 7 and 6 tokens, then padding; row 1: one document of 16."""
  rng = np.random.RandomState(0)
  inputs = rng.randint(1, 50, (B, S)).astype(np.int32)
  targets = rng.randint(1, 50, (B, S)).astype(np.int32)
  seg = np.array([[1] * 7 + [2] * 6 + [0] * 3, [1] * 16], np.int32)
  pos = np.array([list(range(7)) + list(range(6)) + [0] * 3, list(range(16))], np.int32)
  # within a document, the target is the next input (as packing makes them)
  for b in range(B):
    for t in range(S - 1):
      if seg[b, t] and seg[b, t + 1] == seg[b, t]:
        targets[b, t] = inputs[b, t + 1]
  targets = np.where(seg != 0, targets, 0)
  return {"inputs": inputs, "targets": targets, "inputs_position": pos,
          "inputs_segmentation": seg, "targets_segmentation": seg.copy()}


def rms(x, scale, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def reference_sums(mcfg, model_def, params, batch):
  """(nll sum per depth, tokens per depth) computed in NumPy around the model's MTP layers."""
  # the model's own modules, each call one jitted program (not one per eager op)
  @jax.jit
  def hidden(p):
    module = nnx.merge(model_def.graphdef, p)
    return module.forward_with_aux(batch["inputs"], batch["inputs_position"],
                                   batch["inputs_segmentation"], return_hidden=True)[0]

  @partial(jax.jit, static_argnums=1)
  def mtp_layer(p, j, u):
    module = nnx.merge(model_def.graphdef, p)
    return module.mtp.layers[j]((u, {}), batch["inputs_position"], seg)[0]

  p_jnp = jax.device_put(params)   # (jnp.asarray would compile a staging program per shape)
  h = np.asarray(hidden(p_jnp), np.float64)
  emb, head = params["embedding"].astype(np.float64), params["lm_head"]["kernel"]
  mtp, eps = params["mtp"], mcfg.norm_epsilon
  inputs, seg = batch["inputs"], batch["inputs_segmentation"]
  nll, count = [], []
  for j in range(mcfg.mtp_num_layers):
    k = j + 1
    ahead = np.zeros_like(inputs)
    ahead[:, :S - k] = inputs[:, k:]
    u = np.concatenate([rms(emb[ahead], mtp["pre_fc_norm_embedding"]["scale"], eps),
                        rms(h, mtp["pre_fc_norm_hidden"]["scale"], eps)], axis=-1)
    u = u @ mtp["fc"]["kernel"]
    u = mtp_layer(p_jnp, j, u.astype(np.float32))
    h = rms(np.asarray(u, np.float64), mtp["norm"]["scale"], eps)
    logits = h @ head
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    total, n = 0.0, 0
    for b in range(B):
      for t in range(S - k):
        if seg[b, t] and seg[b, t + k] == seg[b, t] and batch["targets_segmentation"][b, t + k]:
          total -= logp[b, t, batch["targets"][b, t + k]]
          n += 1
    nll.append(total)
    count.append(n)
  return np.array(nll), np.array(count)


@pytest.fixture(scope="module")
def reference(model):
  """The NumPy reference of packed_batch(), once for both chunkings."""
  mcfg, model_def, params = model
  return reference_sums(mcfg, model_def, params, packed_batch())


@pytest.mark.parametrize("chunk", [0, 4])
def test_mtp_loss_equals_numpy_reference(model, reference, chunk):
  mcfg, model_def, params = model
  want_nll, want_n = reference
  assert list(want_n) == [6 + 5 + 15, 5 + 4 + 14]   # per document: its length - 1 - k
  micro = jax.device_put(packed_batch())
  terms = MTPTerms(mcfg.mtp_loss_scale, mcfg.mtp_num_layers)

  @jax.jit
  def loss_and_metrics(p):   # the step's own functions, as one program (as in the step)
    _, _, n, aux = token_loss_sums(model_def, p, micro, z_loss_weight=0.0, chunk=chunk)
    extra, sums = terms.loss(aux)
    return aux["mtp_sums"], extra, terms.metrics(sums, n)

  (got_nll, got_n), extra, metrics = loss_and_metrics(jax.device_put(params))
  np.testing.assert_allclose(np.asarray(got_nll), want_nll, rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(got_n), want_n)
  np.testing.assert_allclose(float(extra), 0.5 / 2 * want_nll.sum(), rtol=1e-5)
  np.testing.assert_allclose(float(metrics["mtp_loss"]), np.mean(want_nll / want_n), rtol=1e-5)
  np.testing.assert_allclose(float(metrics["mtp_loss/depth_2"]), want_nll[1] / want_n[1],
                             rtol=1e-5)


def test_gradient_reaches_the_mtp_block_and_the_embedding(model):
  mcfg, model_def, params = model
  micro = jax.device_put(packed_batch())
  terms = MTPTerms(mcfg.mtp_loss_scale, mcfg.mtp_num_layers)

  def mtp_only(p):
    _, _, _, aux = token_loss_sums(model_def, p, micro, z_loss_weight=0.0, chunk=0)
    return terms.loss(aux)[0]

  grads = jax.jit(jax.grad(mtp_only))(jax.device_put(params))   # one program
  for path, g in jax.tree_util.tree_flatten_with_path(grads["mtp"])[0]:
    assert np.any(np.asarray(g) != 0), jax.tree_util.keystr(path)
  assert np.any(np.asarray(grads["embedding"]) != 0)     # the token-ahead embeddings
  assert np.any(np.asarray(grads["lm_head"]["kernel"]) != 0)   # the shared head
  # the decoder's layers get the MTP loss's gradient through the hidden state depth 1 reads
  assert any(np.any(np.asarray(g) != 0) for g in jax.tree.leaves(grads["decoder"]))


def test_training_logs_the_mtp_loss_and_moves_the_block(tmp_path):
  # 4 steps (warmup 2): three updates move the block and lower its loss (not 10 steps)
  code, rows, state = train(tmp_path, "mtp", "mtp_num_layers=1", "mtp_loss_scale=0.5", "steps=4",
                            "enable_checkpointing=false", *MESH_1, devices=jax.devices()[:1])
  assert code == 0
  mtp_loss = [r["mtp_loss"] for r in rows]
  assert len(mtp_loss) == 4 and mtp_loss[-1] < mtp_loss[0] and "mtp_loss/depth_1" in rows[0]
  mcfg = ModelConfig.from_config(load_config([BASE_YML, "emb_dim=64", "num_decoder_layers=2",
                                              "num_query_heads=4", "num_kv_heads=2",
                                              "head_dim=16", "mlp_dim=128", "vocab_size=264",
                                              "mtp_num_layers=1", "mtp_loss_scale=0.5"]))
  initial = init_params(mcfg, 0)
  moved = [np.any(np.asarray(a) != np.asarray(b)) for a, b in
           zip(jax.tree.leaves(state["params"]["mtp"]), jax.tree.leaves(initial["mtp"]))]
  assert all(moved)


@pytest.mark.parametrize("keys,named", [
    (("model_name=gemma4-tiny", "mtp_num_layers=1"), "mtp_num_layers=1 is not supported by "
                                                     "decoder_block=gemma4"),
    (("mtp_loss_scale=0.5",), "mtp_loss_scale=0.5 trains the multi-token-prediction block, but "
                              "mtp_num_layers=0")])
def test_refused_before_compiling(tmp_path, capsys, keys, named):
  code, _, _ = train(tmp_path, "bad", *keys, *MESH_1, devices=jax.devices()[:1])
  assert code == 2
  assert named in capsys.readouterr().err
