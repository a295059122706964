"""issue 55: every training method's step is the one update builder (MaxText/train/update.py) with
the method's objective (MaxText/methods/), and every feature the builder owns gives the method's
own single-path result — or is refused with exit 2 naming the key.

For each method (pre-training, distillation, DPO, GRPO) and feature (LoRA, ZeRO-1 with gradient
accumulation on the suite's 8 devices, the MoE router-bias update) the builder's jitted step, on the
8-device mesh (data 2 x fsdp 2 x tensor 2) with the feature on, is compared with a reference
written out here without the builder: the objective's loss on the whole batch on one device, its
gradient by `jax.value_and_grad`, the update by optax's chain (tests/optax_oracle.py's oracle) and
the family's changes outside the gradient after it. Same loss and gradient norm (fp32 rounding),
same new parameters. Accumulation runs 2 micro-batches of half the rows, under ZeRO-1 (the moments
sharded over the data axis; GRPO, which refuses gradient_accumulation_steps, in one) and under the
router bias (the moments replicated; its statistics summed across the micro-batches); LoRA trains
the adapters only (the base must not move); the router bias must move, and as the reference moves
it. (Accumulation and ZeRO-1 were each a case of their own: one more step program per method, for
no path the pair misses.) A refused pair runs the trainer's `main` (tests/test_method_features.py's table): exit 2, the
key named. One tiny model per feature; the reference and the builder each compile once per pair.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import argv
from test_method_features import FEATURES as CONFIG_FEATURES
from test_method_features import MODEL, REFUSED, _method

METHODS = ("pretrain", "distill", "dpo", "grpo")
TOOL = {"pretrain": "train", "distill": "distill", "dpo": "dpo", "grpo": "grpo"}
FEATURES = ("lora", "zero1", "router_bias")
RUN = ["ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2",
       "per_device_batch_size=1", "learning_rate=0.001", "warmup_steps=0",
       "lr_schedule=constant", "enable_checkpointing=false"]
OWN = {"lora": ["lora_rank=4", "shard_optimizer_over_data=false"],
       "zero1": ["shard_optimizer_over_data=true"],
       "router_bias": ["num_experts=4", "num_experts_per_tok=2", "moe_mlp_dim=32",
                       "router_bias_update_rate=0.01", "shard_optimizer_over_data=false"]}
ROWS, SEQ, VOCAB = 8, 16, 264


@functools.lru_cache(maxsize=None)
def _trainer(feature: str):
  import tempfile  # pylint: disable=import-outside-toplevel
  from MaxText.config.load import load_config  # pylint: disable=import-outside-toplevel
  from MaxText.train.loop import Trainer  # pylint: disable=import-outside-toplevel
  return Trainer(load_config(argv(tempfile.mkdtemp(), "m", *RUN, *OWN[feature], model=MODEL)))


def _rows(rng, n):
  tokens = rng.integers(1, VOCAB, (n, SEQ + 1)).astype(np.int32)
  seg = np.ones((n, SEQ), np.int32)
  seg[:, SEQ - 3:] = 0                                      # padding at every row's end
  seg[1, SEQ - 6:] = 0
  return tokens[:, :-1], tokens[:, 1:], np.tile(np.arange(SEQ, dtype=np.int32), (n, 1)), seg


def _batch(method: str, rng) -> dict:
  inputs, targets, positions, seg = _rows(rng, ROWS)
  if method in ("pretrain", "distill"):
    return {"inputs": inputs * seg, "targets": targets * seg, "inputs_position": positions * seg,
            "inputs_segmentation": seg, "targets_segmentation": seg}
  if method == "dpo":
    other = _rows(rng, ROWS)
    side = lambda r: {"inputs": r[0], "targets": r[1], "positions": r[2], "segments": r[3],
                      "mask": (r[3] * (r[2] >= 5)).astype(np.float32),
                      "real": r[3].astype(np.float32)}
    return {"chosen": side((inputs, targets, positions, seg)), "rejected": side(other),
            "ref": {"chosen": rng.normal(-20, 2, ROWS).astype(np.float32),
                    "rejected": rng.normal(-20, 2, ROWS).astype(np.float32)}}
  mask = (seg * (positions >= 6)).astype(np.float32)
  return {"inputs": inputs, "targets": targets, "positions": positions, "segments": seg,
          "mask": mask, "weight": np.array([1, 1, 1, 0.5, 1, 1, 1, 0], np.float32),
          "old_logprobs": (-rng.uniform(4.5, 6.5, (ROWS, SEQ)) * mask).astype(np.float32),
          "reference_logprobs": (-rng.uniform(4.5, 6.5, (ROWS, SEQ)) * mask).astype(np.float32),
          "advantages": (rng.normal(0, 1, (ROWS, 1)) * mask).astype(np.float32)}


def _objective(method: str, tr):
  # pylint: disable=import-outside-toplevel
  from MaxText.losses.distill import DistillSpec
  from MaxText.methods.grpo import grpo_loss
  from MaxText.methods.registry import objective
  if method == "pretrain":
    return objective("pretrain", z_loss_weight=1e-4)
  if method == "distill":
    return objective("distill", teacher_def=_trainer("zero1").model_def,
                     spec=DistillSpec("jsd", 0.5, 2.0, 0.5))
  if method == "dpo":
    return objective("dpo", loss_kwargs=dict(loss="sigmoid", beta=0.1, label_smoothing=0.0,
                                             simpo_gamma=0.0))
  del tr
  return objective("grpo", loss_fn=grpo_loss(dict(beta=0.04), use_reference=True))


def _batch_shardings(method: str, tr):
  # pylint: disable=import-outside-toplevel
  if method == "dpo":
    from MaxText.dpo.step import batch_shardings
    return batch_shardings(tr.mesh, tr.rules, ROWS, SEQ)
  if method == "grpo":
    from MaxText.rl.step import batch_shardings
    return batch_shardings(tr.mesh, tr.rules, ROWS, SEQ)
  return {k: tr.batch_shardings[k] for k in tr.row_specs}


_references: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _release_references():
  """The shared references go with this file, not the worker."""
  yield
  _references.clear()


def _reference(objective, tr, state, batch, side):
  """One step without the builder: whole batch, one device, jax.value_and_grad, optax's chain."""
  from MaxText.layers import lora  # pylint: disable=import-outside-toplevel
  cpu = jax.devices()[0]
  state, batch, side = jax.device_put(jax.device_get((state, batch, side)), cpu)
  split = lora.split if tr.adapters_only else (lambda p: (p, {}))
  join = lora.join if tr.adapters_only else (lambda t, _: t)
  aux_terms = tr.aux_terms

  def run(state, batch, side):
    trained, frozen = split(state["params"])
    totals = objective.totals(batch)

    def f(t):
      out = objective.loss(join(t, frozen), {**batch, **totals}, tr.model_def, side)
      loss, fam = out.loss, None
      if aux_terms is not None and out.aux is not None:
        extra, fam = aux_terms.loss(out.aux)
        loss = loss + extra if objective.adds_aux_loss else loss
      return loss, (out.sums, fam, jnp.asarray(out.tokens, jnp.float32))

    (loss, (sums, fam, tokens)), grads = jax.value_and_grad(f, has_aux=True)(trained)
    divisor, metrics = objective.finish(loss, sums, tokens, totals)
    if divisor is not None:
      grads = jax.tree.map(lambda g: g / divisor, grads)
    updates, _ = tr.tx.update(grads, state["opt_state"], trained)
    new = join(optax.apply_updates(trained, updates), frozen)
    if fam is not None and not tr.adapters_only:
      new = aux_terms.update(new, fam)
    return new, metrics["loss"], optax.tree.norm(grads)
  return jax.jit(tr.model_def.at_precision(run))(state, batch, side)


@pytest.mark.parametrize("method,feature", [(m, f) for m in METHODS for f in FEATURES])
def test_a_feature_equals_the_methods_single_path_or_is_refused(tmp_path, capsys, method,
                                                                   feature):
  if (TOOL[method], feature) in REFUSED:
    from MaxText.train.loop import main  # pylint: disable=import-outside-toplevel
    trainer, config, data = _method(TOOL[method], tmp_path)
    code = main(argv(tmp_path / "runs", "run", *data, *CONFIG_FEATURES[feature], config=config,
                     model=MODEL), trainer_class=trainer)
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and last.startswith(f"config error: {REFUSED[(TOOL[method], feature)][0]}")
    return
  # pylint: disable=import-outside-toplevel
  from MaxText.layers import lora
  from MaxText.train import update
  from MaxText.train.state import init_state
  tr = _trainer(feature)
  assert tr.tx.shard_over_data == (feature == "zero1")
  assert tr.adapters_only == (feature == "lora")
  objective = _objective(method, tr)
  state = init_state(tr.mcfg, 0, tr.tx, tr.shardings)
  shardings = _batch_shardings(method, tr)
  host = _batch(method, np.random.default_rng(7))
  batch = jax.tree.map(lambda v, sh: jax.device_put(v, sh), host, shardings)
  side, side_shardings = None, None
  if method == "distill":
    teacher = _trainer("zero1")
    side_shardings = teacher.shardings["params"]
    side = jax.device_put(init_state(teacher.mcfg, 1, teacher.tx, teacher.shardings)["params"],
                          side_shardings)
  key = (method, feature)
  if key not in _references:
    _references[key] = jax.device_get(_reference(objective, tr, state, batch, side))
  want_params, want_loss, want_norm = _references[key]
  old = jax.device_get(state["params"])
  accum = 2 if feature == "router_bias" or (
      feature == "zero1" and (TOOL[method], "grad_accum") not in REFUSED) else 1
  step = update.jit_update(
      update.make_update(objective, tr.model_def, tr.tx, mesh=tr.mesh, rules=tr.rules,
                         lr_schedule=tr.lr_schedule, grad_accum=accum, aux_terms=tr.aux_terms,
                         adapters_only=tr.adapters_only, count_step=method != "grpo"),
      tr.shardings, shardings, tr.mesh, side_shardings)
  new_state, metrics = step(state, batch) if side is None else step(state, batch, side)
  metrics = jax.device_get(metrics)
  assert metrics["finite"] == 1.0
  np.testing.assert_allclose(metrics["loss"], want_loss, rtol=2e-5)
  np.testing.assert_allclose(metrics["grad_norm"], want_norm, rtol=2e-4)
  got = jax.device_get(new_state["params"])
  flat_old = jax.tree_util.tree_leaves_with_path(old)
  moved = set()
  for (path, o), g, w in zip(flat_old, jax.tree.leaves(got), jax.tree.leaves(want_params)):
    # Adam's first update is u = lr·g/(|g| + eps), about ±lr (1e-3) per element whatever the
    # gradient's size: a wrong gradient moves most elements by ~lr. A rounding δ of g (the
    # features' own reduction orders: |δ| ~ 2^-24·Σ|terms|, ~1e-9 here) moves u by
    # lr·eps·|δ|/(|g| + eps)² (eps = 1e-8): far under lr/10 unless |g| is itself within a few eps,
    # and never over lr·|δ|/eps ≤ lr. Such near-zero gradients are rare (1 element of 8,448 and
    # of 1,024 in the runs that showed it: 1.3e-4, 2.4e-4): at most one in 500, none over lr.
    off = np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64))
    where = jax.tree_util.keystr(path)
    assert off.max() <= 1e-3, (where, off.max())
    assert (off > 1e-4).sum() <= max(1, off.size // 500), (where, int((off > 1e-4).sum()))
    if not np.array_equal(g, o):
      moved.add(jax.tree_util.keystr(path))
  assert moved, "the step changed no parameter"
  if feature == "lora":
    assert all(p.split("'")[-2] in lora.ADAPTERS for p in moved), sorted(moved)
  if feature == "router_bias":
    assert any("router_bias" in p for p in moved), sorted(moved)


def test_methods_are_keyed_like_families():
  """The table's methods load by name; one defined elsewhere registers and unregisters; an unknown
  name is a ConfigError naming it and the known ones."""
  # pylint: disable=import-outside-toplevel
  from MaxText.config.load import ConfigError
  from MaxText.methods import registry
  from MaxText.methods.objective import Objective
  assert set(METHODS) == set(registry.METHOD_MODULES) == set(registry.names())
  for name in METHODS:
    method = registry.get_method(name)
    assert method.name == name and issubclass(method.objective, Objective)
  registry.register(registry.Method("plug_in", Objective))
  try:
    assert "plug_in" in registry.names() and registry.get_method("plug_in").objective is Objective
  finally:
    registry.unregister("plug_in")
  with pytest.raises(ConfigError, match="method 'plug_in': unknown training method .*dpo"):
    registry.get_method("plug_in")
