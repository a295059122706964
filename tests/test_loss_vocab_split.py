"""The LM head split over the vocabulary under the batch axes (`losses/vocab_split.py`: each
device holds a vocabulary slice of the head weights and gathers the hidden rows of the batch): loss
and every gradient equal the one-device ones and the per-batch-shard path's, tied and untied, on 2, 4
and 8 fake devices; the whole head weight is never gathered (only its slices exist); the split falls
back where it does not apply; and the RL log-prob path's split equals its one-device values."""
import functools
import re

import jax
import numpy as np
import pytest

from conftest import BASE_YML
from test_loss import (MODEL, S, batch, build, rel, _mean_loss, _sharded_loss_and_grads,
                       _sharded_step)
from MaxText.config.load import load_config
from MaxText.losses import chunked as loss_mod
from MaxText.losses.vocab_split import vocab_split_plan
from MaxText.models.model_config import ModelConfig
from MaxText.models.registry import init_params, make_model_def
from MaxText.sharding.mesh import create_mesh
from MaxText.sharding.rules import parse_rules, use_rules

V = 512          # divides 2, 4 and 8 slices; 8 rows x 48 positions = 384 tokens <= V: split
ROWS = 4         # copies of the test batch: 8 rows


def _mesh_rules(devices, *mesh_keys):
  cfg = load_config([BASE_YML, *MODEL, *mesh_keys])
  return create_mesh(cfg, devices), parse_rules(cfg.logical_axis_rules, cfg.mesh_axes)


def _sharded(model_def, params, micro, chunk, devices, *mesh_keys, hlo=True):
  return _sharded_loss_and_grads(model_def, params, micro, chunk, *mesh_keys, devices=devices,
                                 hlo=hlo)


@functools.lru_cache(maxsize=None)
def _head_case(tied, chunk, n, mesh):
  """The tied or untied V-vocabulary model on the test batch's ROWS copies, its loss and gradients
  with `chunk` under `mesh` over the first n devices (one device without a mesh) and the compiled
  HLO text: computed once per process, so a test that runs a program an earlier test ran (the same
  model, batch, chunk and mesh) reads its results instead of tracing and lowering it again."""
  model_def, params = build(f"vocab_size={V}", f"tie_word_embeddings={str(tied).lower()}")
  micro = {k: np.concatenate([v] * ROWS) for k, v in batch(V).items()}
  if not mesh:
    return jax.jit(jax.value_and_grad(lambda p: _mean_loss(p, model_def, micro, chunk)))(params)
  step, shardings = _sharded_step(model_def, micro, chunk, *mesh, devices=jax.devices()[:n])
  placed = jax.device_put(params, shardings)
  compiled = step.lower(placed).compile()   # once: the program run is the one whose text is read
  return compiled(placed), compiled.as_text()


def _gathered_shapes(hlo: str) -> list[str]:
  """The result shapes of the compiled program's all-gathers, without their layouts: f32[32,512]."""
  return re.findall(r"= (\w+\[[\d,]*\])\S* all-gather\(", hlo)


def _plan(model_def, params, micro, devices, *mesh_keys):
  mesh, rules = _mesh_rules(devices, *mesh_keys)
  D = model_def.abstract_params["final_norm"]["scale"].shape[0]
  with use_rules(mesh, rules):
    return vocab_split_plan(model_def.head, params, model_def.logical_axes,
                            jax.numpy.zeros((micro["inputs"].shape[0], S, D)), 16)


# both heads on both kinds of mesh: the vocabulary split over fsdp alone (2 or 8 slices: the same
# program but for the slice count; tied on 2, untied on 8) and over data x fsdp (both heads)
@pytest.mark.parametrize("n,mesh,tied", [(2, ("ici_fsdp_parallelism=2",), True),
                                         (4, ("ici_data_parallelism=2", "ici_fsdp_parallelism=2"),
                                          False),
                                         (4, ("ici_data_parallelism=2", "ici_fsdp_parallelism=2"),
                                          True),
                                         (8, ("ici_fsdp_parallelism=8",), False)])
def test_vocab_split_equals_one_device(n, mesh, tied):
  model_def, params = build(f"vocab_size={V}", f"tie_word_embeddings={str(tied).lower()}")
  micro = {k: np.concatenate([v] * ROWS) for k, v in batch(V).items()}
  devices = jax.devices()[:n]
  assert _plan(model_def, params, micro, devices, *mesh) is not None
  ref_loss, ref_grads = _head_case(tied, 0, 1, ())   # one per head, shared by its two meshes
  (loss, grads), hlo = _head_case(tied, 16, n, mesh)
  # one device vs the mesh: the loss's sums and the hidden gradient are reduced over the slices
  # and devices in another fp32 order, and the rest of the model's sharded reductions add theirs
  # (1e-5, as the per-batch-shard test in test_loss.py)
  assert rel(loss, ref_loss) < 1e-5, (float(loss), float(ref_loss))
  for (path, a), b in zip(jax.tree.leaves_with_path(ref_grads), jax.tree.leaves(grads)):
    assert rel(b, a) < 1e-5, (jax.tree_util.keystr(path), rel(b, a))
  # the head weight [V, 32] / [32, V] is never gathered whole: only its [V / n] slices exist (and
  # its gradient goes back to the weight's sharding without a whole copy: under data x fsdp, XLA
  # alone gathered it whole, "Involuntary full rematerialization")
  head_shapes = {f"f32[{V},32]", f"f32[32,{V}]"}
  assert not head_shapes & set(_gathered_shapes(hlo)), _gathered_shapes(hlo)
  assert re.search(r"reduce-scatter\(", hlo)           # the hidden rows' gradient


@pytest.mark.parametrize("tied", [False, True])
def test_vocab_split_chunked_equals_whole_under_the_mesh(tied):
  """The split chunked loss vs the whole-sequence loss (no split: [B, S, V] logits) under the same
  4-device mesh: the same terms summed in another fp32 order."""
  mesh = ("ici_data_parallelism=2", "ici_fsdp_parallelism=2")
  (whole, whole_g), _ = _head_case(tied, 0, 4, mesh)
  # the split run is test_vocab_split_equals_one_device's 4-device case of this head (the same
  # program: computed once per process)
  (split, split_g), _ = _head_case(tied, 16, 4, mesh)
  assert rel(split, whole) < 1e-6
  for (path, a), b in zip(jax.tree.leaves_with_path(whole_g), jax.tree.leaves(split_g)):
    assert rel(b, a) < 1e-6, (jax.tree_util.keystr(path), rel(b, a))


def test_vocab_split_falls_back():
  """No split (the per-batch-shard loop) where it does not apply."""
  devices = jax.devices()
  model_def, params = build(f"vocab_size={V}")
  micro = {k: np.concatenate([v] * ROWS) for k, v in batch(V).items()}
  fsdp8 = ("ici_fsdp_parallelism=8",)
  assert _plan(model_def, params, micro, devices, *fsdp8) is not None
  # the vocabulary does not divide into 8 slices
  odd_def, odd_params = build("vocab_size=516")
  assert _plan(odd_def, odd_params, micro, devices, *fsdp8) is None
  # more tokens than the vocabulary: gathering the rows would move more than the weights
  long = {k: np.concatenate([v] * 2 * ROWS) for k, v in batch(V).items()}
  assert _plan(model_def, params, long, devices, *fsdp8) is None
  # a mesh axis that does not split the batch (tensor: the vocabulary already)
  assert _plan(model_def, params, micro, devices, "ici_fsdp_parallelism=4",
               "ici_tensor_parallelism=2") is None


def test_vocab_split_soft_capped_tied_head():
  """Gemma 4's tied, soft-capped head (tanh per logit: per slice) split over 4 devices: the loss
  equals one device's, loss and gradients the whole-sequence loss's under the same mesh (Gemma's
  attention scale 1.0 amplifies the mesh's own fp32 reordering in the attention gradients with or
  without the split, so those compare like with like).

  The gradients' bound, per leaf: the split differs from the whole-sequence loss only in the order
  of the loss's own sums (the log-sum-exp combined over slices and chunks). Such a reordering moves
  each softmax probability by a few fp32 units (u = 2**-24) relatively, and a leaf's gradient by
  that times the leaf's cancellation (sum of |contributions| over |sum|), which differs per leaf
  and per CPU (the matmuls' own blocking). One device's chunked loss vs its whole-sequence loss is
  the same kind of reordering of the same sums, so the test measures that per leaf (`noise`) and
  allows 4x it (the split's extra slice combination at most doubles the terms reordered; 2x more
  for the spread between reorderings), and never less than 8u for leaves whose noise is ~0."""
  # the head is the point: a body of one sliding and one full layer (no KV-shared tail, no
  # per-layer inputs: layer kinds of their own that each of the five programs here would compile)
  keys = ["model_name=gemma4-tiny", "num_decoder_layers=2", "attention_pattern=sf",
          "num_kv_shared_layers=0", "per_layer_input_dim=0", "sliding_window=16",
          f"max_target_length={S}"]
  mcfg = ModelConfig.from_config(load_config([BASE_YML, *keys]))
  model_def, params = make_model_def(mcfg), jax.device_get(init_params(mcfg, 0))   # host arrays
  micro = {k: np.concatenate([v] * 2) for k, v in batch(mcfg.vocab_size).items()}   # 4 rows
  mesh, devices = ("ici_fsdp_parallelism=4",), jax.devices()[:4]
  assert _plan(model_def, params, micro, devices, *mesh) is not None
  one_device = jax.jit(jax.value_and_grad(lambda p, c: _mean_loss(p, model_def, micro, c)),
                       static_argnums=1)
  (ref_loss, ref_g), (_, ref_chunked_g) = one_device(params, 0), one_device(params, 16)
  (whole, whole_g), _ = _sharded(model_def, params, micro, 0, devices, *mesh, hlo=False)
  (split, split_g), _ = _sharded(model_def, params, micro, 16, devices, *mesh, hlo=False)
  assert rel(split, ref_loss) < 1e-5 and rel(split, whole) < 1e-6, (float(split), float(whole))
  u = 2.0 ** -24
  for (path, a), b, r, rc in zip(jax.tree.leaves_with_path(whole_g), jax.tree.leaves(split_g),
                                 jax.tree.leaves(ref_g), jax.tree.leaves(ref_chunked_g)):
    bound = max(4 * rel(rc, r), 8 * u)
    assert rel(b, a) < bound, (jax.tree_util.keystr(path), rel(b, a), bound)


@pytest.mark.parametrize("n,mesh,tied", [(2, ("ici_fsdp_parallelism=2",), False),
                                         (4, ("ici_data_parallelism=2", "ici_fsdp_parallelism=2"),
                                          True)])
def test_vocab_split_log_probs_equal_one_device(n, mesh, tied):
  """The RL log-prob path (`chunked_target_log_probs`, GRPO's) split over the vocabulary: log p,
  the entropy and the gradients of a weighted sum of both (head weights and hidden state) equal
  the one-device chunked path's (fp32: only the log-sum-exp's combination across slices differs),
  and the whole head weight is never gathered."""
  from jax.sharding import NamedSharding, PartitionSpec as Spec
  from MaxText.sharding.rules import tree_shardings
  model_def, params = build(f"vocab_size={V}", f"tie_word_embeddings={str(tied).lower()}")
  micro = {k: np.concatenate([v] * ROWS) for k, v in batch(V).items()}
  hidden, _ = jax.jit(model_def.apply_hidden)(params, micro["inputs"], micro["inputs_position"],
                                              micro["inputs_segmentation"])
  rng = np.random.default_rng(2)
  w_lp, w_ent = (rng.normal(size=hidden.shape[:2]).astype(np.float32) for _ in range(2))

  def weighted(p, h):
    logp, ent = loss_mod.chunked_target_log_probs(model_def.head, p, h, micro["targets"], 16,
                                                  entropy=True,
                                                  logical_axes=model_def.logical_axes)
    return jax.numpy.sum(w_lp * logp + w_ent * ent), (logp, ent)

  grad = jax.value_and_grad(weighted, argnums=(0, 1), has_aux=True)
  (ref_v, (ref_lp, ref_ent)), ref_g = jax.jit(grad)(params, hidden)
  devices = jax.devices()[:n]
  plan = _plan(model_def, params, micro, devices, *mesh)
  assert plan is not None
  mesh_, rules = _mesh_rules(devices, *mesh)
  shardings = tree_shardings(model_def.logical_axes, model_def.abstract_params, mesh_, rules)
  rows = NamedSharding(mesh_, Spec(plan.axes))

  def sharded(p, h):
    with use_rules(mesh_, rules):
      return grad(p, h)

  step = jax.jit(sharded, in_shardings=(shardings, rows))
  args = (jax.device_put(params, shardings), jax.device_put(hidden, rows))
  compiled = step.lower(*args).compile()   # once: the program run is the one whose text is read
  (v, (lp, ent)), g = compiled(*args)
  # host copies for the comparisons below (jax arrays would run each difference and product as a
  # program of its own: a compile each)
  v, lp, ent, ref_v, ref_lp, ref_ent = (np.asarray(x) for x in (v, lp, ent, ref_v, ref_lp, ref_ent))
  assert rel(lp, ref_lp) < 1e-6, rel(lp, ref_lp)
  # the entropy is lse − Σ p·logit, a difference of terms of the log-sum-exp's size (~3x the
  # entropy here, tied): both paths round those to fp32 (each ~8e-7 of the entropy from a float64
  # oracle), so 1e-6 of the log-sum-exp
  lse = np.asarray(jax.jit(lambda p, h: jax.nn.logsumexp(model_def.head(p, h), axis=-1))(params,
                                                                                      hidden))
  assert np.linalg.norm(ent - ref_ent) < 1e-6 * np.linalg.norm(lse), rel(ent, ref_ent)
  # the weighted sum cancels (weights of both signs): 1e-6 of the sum of its terms' sizes
  assert abs(v - ref_v) < 1e-6 * np.sum(np.abs(w_lp * ref_lp) + np.abs(w_ent * ref_ent))
  # the gradients carry the entropy's cancellation too (its part p·(logit − mean logit)): 1e-6
  # times the log-sum-exp's size over the entropy's
  tol = 1e-6 * max(1.0, float(np.linalg.norm(lse) / np.linalg.norm(ref_ent)))
  for (path, a), b in zip(jax.tree.leaves_with_path(ref_g), jax.tree.leaves(g)):
    assert rel(b, a) < tol or (not np.any(a) and not np.any(b)), (jax.tree_util.keystr(path),
                                                                   rel(b, a), tol)
  hlo = compiled.as_text()
  assert not {f"f32[{V},32]", f"f32[32,{V}]"} & set(_gathered_shapes(hlo)), _gathered_shapes(hlo)
  assert re.search(r"reduce-scatter\(", hlo)           # the hidden rows' gradient
  if n == 2:   # bf16 hidden rows (a bf16 run's): their gradient's reduce-scatter compiles (in fp32)
    h16 = np.asarray(hidden).astype(jax.numpy.bfloat16)   # on the host: no cast program
    (_, (lp16, _)), g16 = step(args[0], jax.device_put(h16, rows))
    (_, (ref_lp16, _)), ref_g16 = jax.jit(grad)(params, h16.astype(np.float32))
    assert g16[1].dtype == jax.numpy.bfloat16 and rel(lp16, ref_lp16) < 1e-6
    assert rel(g16[1], ref_g16[1]) < 2 ** -8, rel(g16[1], ref_g16[1])    # rounded to bf16
