"""Chunked cross-entropy (`losses/chunked.py`): loss, z-loss and every gradient equal the whole-sequence
version (fp32, only the summation order differs), token log-probabilities too, and the compiled
step's temporary memory shrinks with the chunk. With `logits_dtype=bfloat16` both are the float64
cross-entropy of the logits rounded to bf16, and `lse_and_target_logit`'s bf16 branch is the float64
log-sum-exp of the same values."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BASE_YML
from MaxText.config.load import load_config
from MaxText.losses.chunked import chunked_target_log_probs
from MaxText.losses.token_loss import token_loss_sums
from MaxText.losses.token_stats import (cross_entropy_sums, logits_cotangent, lse_and_target_logit,
                                        target_log_probs)
from MaxText.models.model_config import ModelConfig
from MaxText.models.registry import init_params, make_model_def

B, S = 2, 48
MODEL = ["emb_dim=32", "num_decoder_layers=2", "num_query_heads=4", "num_kv_heads=2", "head_dim=8",
         "mlp_dim=48", "vocab_size=300", f"max_target_length={S}", "init_std=0.5"]


def model_config(*overrides) -> ModelConfig:
  """MODEL with `overrides`, a later value of a key replacing an earlier one."""
  keys = dict(kv.split("=", 1) for kv in [*MODEL, *overrides])
  return ModelConfig.from_config(load_config([BASE_YML, *(f"{k}={v}" for k, v in keys.items())]))


@functools.lru_cache(maxsize=None)
def build(*overrides):
  """(model def, its random init as host arrays): built once per `overrides` in a process (the
  tests here and in test_loss_vocab_split.py share them; the arrays are immutable). Host arrays:
  placing them on a mesh slices them on the host (a device array's placement compiles a slicing
  program per shape)."""
  mcfg = model_config(*overrides)
  return make_model_def(mcfg), jax.device_get(init_params(mcfg, 0))


def batch(vocab=300):
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, vocab, (B, S + 1)).astype(np.int32)
  seg = np.ones((B, S), np.int32)
  seg[1, 30:] = 2                     # two packed documents in row 1
  seg[0, 40:] = 0                     # padding at the end of row 0
  pos = np.where(seg[1] == 2, np.arange(S) - 30, np.arange(S))
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "inputs_segmentation": seg,
          "targets_segmentation": seg, "inputs_position": np.stack([np.arange(S), pos]).astype(np.int32)}


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


@functools.lru_cache(maxsize=None)
def _loss_and_grad(*overrides):
  """The jitted mean loss (with z-loss and count) of `build(*overrides)`'s model and its gradient,
  the chunk length static."""
  model_def = build(*overrides)[0]

  def loss(p, micro, c):
    nll, z, n, _ = token_loss_sums(model_def, p, micro, z_loss_weight=1e-2, chunk=c)
    return nll / n, (z, n)
  return jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=2)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunk", [16, 20])      # 3 even chunks; 3 chunks with a padded last one
def test_chunked_loss_and_grads_equal_the_whole_sequence(tied, chunk):
  # MODEL's untied head spelled as the other tests here spell it (no key): one model, one init
  tie = ("tie_word_embeddings=true",) if tied else ()
  model_def, params = build(*tie)
  micro = batch()
  grad = _loss_and_grad(*tie)   # one per model: the whole sequence's program is shared by both
  # chunk lengths (and the untied one by the mesh test's one-device reference)
  (l0, (z0, n0)), g0 = grad(params, micro, 0)
  (l1, (z1, n1)), g1 = grad(params, micro, chunk)
  assert float(n0) == float(n1) == 40 + 48
  # fp32 sums of the same terms in another order: a few ulps of the total
  assert rel(l1, l0) < 1e-6 and rel(z1, z0) < 1e-6, (float(l0), float(l1))
  flat0, flat1 = jax.tree.leaves_with_path(g0), jax.tree.leaves(g1)
  for (path, a), b in zip(flat0, flat1):
    assert rel(b, a) < 1e-6, (jax.tree_util.keystr(path), rel(b, a))


def test_chunked_target_log_probs_equal_whole():
  model_def, params = build()
  micro = batch()
  args = (micro["inputs"], micro["inputs_position"], micro["inputs_segmentation"])
  # each side one jitted program (eagerly, every op compiles on its own)
  hidden, _ = jax.jit(model_def.apply_hidden)(params, *args)
  whole = jax.jit(lambda p, h, t: target_log_probs(model_def.head(p, h), t))(
      params, hidden, micro["targets"])
  chunked = jax.jit(lambda p, h, t: chunked_target_log_probs(model_def.head, p, h, t, 20))(
      params, hidden, micro["targets"])
  assert chunked.shape == (B, S)
  np.testing.assert_allclose(np.asarray(chunked), np.asarray(whole), rtol=1e-6, atol=1e-6)


def test_chunking_cuts_the_logits_memory():
  """With a large vocabulary the [B, S, V] fp32 logits (and their gradient) dominate the step's
  temporary memory; chunks of S/8 positions cut it by more than 4x."""
  V, S_big = 16384, 256
  # compiled, never run: the parameters' shapes alone (no init program) and a host batch (no
  # eager programs), passed as arguments
  model_def = make_model_def(model_config(f"vocab_size={V}", f"max_target_length={S_big}"))
  tokens = np.zeros((B, S_big), np.int32)
  micro = {"inputs": tokens, "targets": tokens, "inputs_segmentation": tokens + 1,
           "targets_segmentation": tokens + 1,
           "inputs_position": np.broadcast_to(np.arange(S_big, dtype=np.int32), (B, S_big))}

  def temp_bytes(chunk):
    f = jax.grad(lambda p, m: token_loss_sums(model_def, p, m, z_loss_weight=0.0, chunk=chunk)[0])
    compiled = jax.jit(f).lower(model_def.abstract_params, micro).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  logits_bytes = B * S_big * V * 4
  whole, chunked = temp_bytes(0), temp_bytes(S_big // 8)
  assert whole > logits_bytes                  # the whole-sequence step holds at least the logits
  assert whole - chunked > 0.75 * logits_bytes, (whole, chunked, logits_bytes)


def _sharded_step(model_def, micro, chunk, *mesh_keys, devices=None):
  """(the jitted mean loss and gradients under a mesh over `devices` (default all), the
  parameters' shardings)."""
  from MaxText.sharding.mesh import create_mesh
  from MaxText.sharding.rules import parse_rules, tree_shardings, use_rules
  cfg = load_config([BASE_YML, *MODEL, *mesh_keys])
  mesh = create_mesh(cfg, jax.devices() if devices is None else devices)
  rules = parse_rules(cfg.logical_axis_rules, cfg.mesh_axes)
  shardings = tree_shardings(model_def.logical_axes, model_def.abstract_params, mesh, rules)

  def sharded(p):
    with use_rules(mesh, rules):
      return jax.value_and_grad(_mean_loss)(p, model_def, micro, chunk)

  return jax.jit(sharded, in_shardings=(shardings,)), shardings


def _sharded_loss_and_grads(model_def, params, micro, chunk, *mesh_keys, devices=None,
                            hlo=True):
  """((mean loss, gradients), the compiled HLO text, or None without `hlo`) under a mesh over
  `devices` (default all)."""
  step, shardings = _sharded_step(model_def, micro, chunk, *mesh_keys, devices=devices)
  placed = jax.device_put(params, shardings)
  if not hlo:
    return step(placed), None
  compiled = step.lower(placed).compile()   # traced and lowered once, for the run and its text
  return compiled(placed), compiled.as_text()


def _mean_loss(p, model_def, micro, chunk):
  nll, _, n, _ = token_loss_sums(model_def, p, micro, z_loss_weight=1e-2, chunk=chunk)
  return nll / n


def test_chunked_loss_under_a_mesh_equals_one_device():
  """data 2 x fsdp 2 x tensor 2 (vocabulary split over tensor): the per-batch-shard chunk loop
  (shard_map) gives the whole-sequence loss and gradients."""
  model_def, params = build()
  micro = {k: np.concatenate([v] * 4) for k, v in batch().items()}     # 8 rows over 4 batch shards
  mesh = ("ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2")
  # one device's reference on the 2 rows the 8 are 4 copies of: the mean loss (sums over 4x the
  # tokens, over 4x the count) and its gradients are the same; the program is the untied case's
  # of test_chunked_loss_and_grads_equal_the_whole_sequence (the same loss, the same z-loss)
  (ref_loss, _), ref_grads = _loss_and_grad()(params, batch(), 0)
  (whole_loss, whole_grads), _ = _sharded_loss_and_grads(model_def, params, micro, 0, *mesh,
                                                         hlo=False)
  (got_loss, got_grads), _ = _sharded_loss_and_grads(model_def, params, micro, 16, *mesh,
                                                     hlo=False)
  # chunked vs whole under the same mesh: 1e-6 (summation order); vs one device: the sharded
  # reductions of the rest of the model add their own fp32 reordering (1e-5, as the EP tests)
  assert rel(got_loss, whole_loss) < 1e-6 and rel(got_loss, ref_loss) < 1e-5
  for (path, a), b, c in zip(jax.tree.leaves_with_path(whole_grads), jax.tree.leaves(got_grads),
                             jax.tree.leaves(ref_grads)):
    assert rel(b, a) < 1e-6 and rel(b, c) < 1e-5, (jax.tree_util.keystr(path), rel(b, a), rel(b, c))


def test_chunk_loop_has_no_collectives_when_only_the_batch_is_split():
  """data 2 x fsdp 4: the head is gathered, and its gradient reduced, outside the chunk loop (a
  scan over globally sharded chunks would do both once per chunk)."""
  # the chunk loop is then the only while loop; compiled, never run (no init program)
  model_def = make_model_def(model_config("scan_layers=false"))
  micro = {k: np.concatenate([v] * 4) for k, v in batch().items()}
  step, shardings = _sharded_step(model_def, micro, 16, "ici_data_parallelism=2",
                                  "ici_fsdp_parallelism=4")
  abstract = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                          model_def.abstract_params, shardings)
  hlo = step.lower(abstract).compile().as_text()
  whiles = re.findall(r"body=%([\w.\-]+)", hlo)   # the chunk loop, forward and backward
  assert whiles
  for name in whiles:
    body = re.search(r"\n%" + re.escape(name) + r" .*?\n}", hlo, re.S).group(0)
    assert not re.search(r"all-gather|all-reduce|reduce-scatter|all-to-all", body), name


def test_training_with_chunked_loss_matches_whole(tmp_path):
  """The train step end to end (8 devices: data 2 x fsdp 2 x tensor 2, two accumulated
  micro-batches): losses and gradient norms of 3 steps with chunks of 16 positions (of 64) equal
  the whole-sequence run."""
  from conftest import MESH_222, train
  common = ("steps=3", "gradient_accumulation_steps=2", "per_device_batch_size=2",
            "enable_checkpointing=false", "z_loss_weight=1e-3", *MESH_222)
  code0, rows0, _ = train(tmp_path, "whole", *common, "loss_chunk_length=0")
  code1, rows1, _ = train(tmp_path, "chunked", *common, "loss_chunk_length=16")
  assert code0 == code1 == 0 and len(rows0) == len(rows1) == 3
  for a, b in zip(rows0, rows1):
    assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(a["loss"]), (a["loss"], b["loss"])
    assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * abs(a["grad_norm"])


def _read_by_the_head(model_def, D):
  """The oracle: which parameter leaves the head's computation reads (traced to a jaxpr)."""
  leaves, treedef = jax.tree.flatten(model_def.abstract_params)
  jaxpr = jax.make_jaxpr(lambda ls, h: model_def.head(jax.tree.unflatten(treedef, ls), h))(
      leaves, jax.ShapeDtypeStruct((2, 4, D), jnp.float32)).jaxpr
  read = {id(v) for eqn in jaxpr.eqns for v in eqn.invars} | {id(v) for v in jaxpr.outvars}
  return [id(v) in read for v in jaxpr.invars[:len(leaves)]]


@pytest.mark.parametrize("overrides", [
    ["model_name=qwen3-tiny"], ["model_name=qwen3-tiny", "tie_word_embeddings=true"],
    ["model_name=gemma4-tiny"], ["model_name=qwen3-next-tiny"],
    ["model_name=qwen3-tiny", "lora_rank=4", "lora_targets=.*"]],
    ids=["untied", "tied", "gemma4", "qwen3-next", "lora-head"])
def test_the_heads_weights_are_named_by_the_family(overrides):
  """The losses take the head's weights by name (the model's `head_params()`, `Head.reads`), not
  by tracing the head: the named leaves are exactly the ones its computation reads."""
  cfg = load_config([BASE_YML, *overrides])
  model_def = make_model_def(ModelConfig.from_config(cfg))
  named = model_def.head.reads(model_def.abstract_params)
  assert any(named)
  assert named == _read_by_the_head(model_def, cfg.emb_dim)


# logits_dtype=bfloat16 (`ModelDef.stored_logits`): the loss reads the logits rounded to bf16 once
Z = 1e-2


def _float64_sums(logits_BSV, micro, z_loss_weight=Z):
  """The oracle: (Σ mask·(lse − logit[target] + z·lse²), Σ mask·z·lse², Σ mask) in float64 from the
  logits as given (e.g. rounded to bf16)."""
  lg = np.asarray(logits_BSV).astype(np.float64)
  m = lg.max(-1, keepdims=True)
  lse = m[..., 0] + np.log(np.exp(lg - m).sum(-1))
  target = np.take_along_axis(lg, np.asarray(micro["targets"])[..., None], -1)[..., 0]
  mask = (np.asarray(micro["targets_segmentation"]) != 0).astype(np.float64)
  z = z_loss_weight * lse ** 2
  return ((lse - target + z) * mask).sum(), (z * mask).sum(), mask.sum()


def test_bf16_logits_loss_is_the_cross_entropy_of_the_rounded_logits():
  """With logits_dtype=bfloat16 the loss, whole and chunked, is the float64 cross-entropy (+ z-loss)
  of the float32 model's logits rounded to bf16, to fp32 rounding; the rounding moves the loss by
  ~10x that tolerance (so an ignored key fails). The gradients of the loss SUM, chunked and whole,
  agree to fp32 summation order: both round the logits' cotangent to bf16 once, at the same value
  (the sum is what the train step differentiates, `train/update.py`, dividing after). Of a mean
  they would differ by ~2^-9 (measured 1e-3 to 3e-3 per leaf): the whole path's autodiff rounds
  the cotangent after the 1/n scale, the chunked path before it, scaling after the head's
  pullback."""
  model_32, params = build()
  model_bf = make_model_def(model_config("logits_dtype=bfloat16"))   # the same parameters
  micro = batch()
  args = (micro["inputs"], micro["inputs_position"], micro["inputs_segmentation"])
  assert jax.eval_shape(model_bf.apply, params, *args).dtype == jnp.bfloat16
  logits_32 = np.asarray(jax.jit(model_32.apply)(params, *args))
  assert logits_32.dtype == np.float32
  want = _float64_sums(logits_32.astype(jnp.bfloat16), micro)
  assert rel(_float64_sums(logits_32, micro)[0], want[0]) > 5e-6

  def loss_sum(p, m, c):
    nll, z, n, _ = token_loss_sums(model_bf, p, m, z_loss_weight=Z, chunk=c)
    return nll, (z, n)
  grad = jax.jit(jax.value_and_grad(loss_sum, has_aux=True), static_argnums=2)
  (l0, (z0, n0)), g0 = grad(params, micro, 0)
  (l1, (z1, n1)), g1 = grad(params, micro, 16)          # 3 chunks of 16 (of 48)
  for loss, z, n in ((l0, z0, n0), (l1, z1, n1)):
    assert float(n) == want[2] == 40 + 48
    assert rel(loss, want[0]) < 1e-6 and rel(z, want[1]) < 1e-6, (float(loss), want)
  for (path, a), b in zip(jax.tree.leaves_with_path(g0), jax.tree.leaves(g1)):
    assert rel(b, a) < 1e-6, (jax.tree_util.keystr(path), rel(b, a))


def test_lse_and_target_logit_of_bf16_logits_against_float64():
  """`lse_and_target_logit`'s bf16 branch (the max taken in bf16, the rest in fp32) and the
  cross-entropy + z-loss sums on it: the float64 log-sum-exp of the same bf16 values to fp32
  rounding, also where exp without the shift would overflow (logits ~ 200); the target logit
  exact; and the gradient with respect to the bf16 logits, mask·((1 + 2z·lse)·softmax − one-hot),
  within one bf16 ulp of it (the cotangent of a bf16 array is bf16; here each entry is the
  float64 value rounded to nearest, but fp32's own error may tip a near tie to the other
  neighbour)."""
  rng = np.random.default_rng(1)
  V, z_weight = 300, 1e-3
  logits = rng.standard_normal((3, 7, V)) * 6
  logits[1] += 200.0
  logits[2, 0] = 3.0                                   # all equal: lse = 3 + log V
  logits = logits.astype(jnp.bfloat16)
  targets = rng.integers(0, V, (3, 7)).astype(np.int32)
  mask = np.ones((3, 7), np.int32)
  mask[0, 5:] = 0

  def f(lg, t, m, z):
    lse, target = lse_and_target_logit(lg, t)
    nll, z_sum, n = cross_entropy_sums(lg, t, m, z)
    return nll, (lse, target, z_sum, n)
  (nll, (lse, target, z_sum, n)), dlogits = jax.jit(jax.value_and_grad(f, has_aux=True))(
      logits, targets, mask, z_weight)
  lg = logits.astype(np.float64)
  m = lg.max(-1, keepdims=True)
  want_lse = m[..., 0] + np.log(np.exp(lg - m).sum(-1))
  assert lse.dtype == target.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-6, atol=0)
  assert abs(float(lse[2, 0]) - (3.0 + np.log(V))) < 1e-6
  np.testing.assert_array_equal(np.asarray(target),
                                np.take_along_axis(lg, targets[..., None], -1)[..., 0])
  micro = {"targets": targets, "targets_segmentation": mask}
  want = _float64_sums(logits, micro, z_weight)
  assert rel(nll, want[0]) < 1e-6 and rel(z_sum, want[1]) < 1e-6 and float(n) == want[2]
  softmax = np.exp(lg - want_lse[..., None])
  onehot = np.arange(V) == targets[..., None]
  want_d = mask[..., None] * ((1 + 2 * z_weight * want_lse)[..., None] * softmax - onehot)
  assert dlogits.dtype == jnp.bfloat16
  got_d = np.asarray(dlogits).astype(np.float64)
  # faithfully rounded: within one bf16 ulp of the exact value (8 significant bits)
  nonzero = want_d != 0
  ulp = 2.0 ** (np.floor(np.log2(np.abs(want_d[nonzero]))) - 7)
  assert (np.abs(got_d[nonzero] - want_d[nonzero]) < ulp).all()
  assert (got_d[0, 5:] == 0).all()
  # rounded once: the fp32 cotangent the chunked loss forms (`logits_cotangent`), cast to bf16
  once = logits_cotangent(logits, lse, targets, mask, z_weight).astype(jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(dlogits), np.asarray(once))
