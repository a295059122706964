"""Learning-rate schedules, weight-decay mask, clipping and the masked cross-entropy."""
import jax
import numpy as np
import pytest

from conftest import BASE_YML
from MaxText.config.load import load_config
from MaxText.losses.token_stats import cross_entropy_sums
from MaxText.train.optimizer import learning_rate_schedule, make_optimizer


def _cfg(*over):
  merged = dict(a.split("=", 1) for a in ("steps=100", "warmup_steps=10", "learning_rate=1.0",
                                          "final_lr_fraction=0.1", *over))
  return load_config([BASE_YML, *(f"{k}={v}" for k, v in merged.items())])


def test_cosine_schedule_points():
  lr = learning_rate_schedule(_cfg("lr_schedule=cosine"))
  assert float(lr(0)) == 0.0
  assert float(lr(5)) == pytest.approx(0.5)
  assert float(lr(10)) == pytest.approx(1.0)
  assert float(lr(55)) == pytest.approx(0.1 + 0.9 * 0.5, abs=1e-6)  # half-way down the cosine
  assert float(lr(100)) == pytest.approx(0.1, abs=1e-6)


def test_wsd_schedule_points():
  lr = learning_rate_schedule(_cfg("lr_schedule=wsd", "wsd_decay_fraction=0.2"))
  assert float(lr(5)) == pytest.approx(0.5)
  assert float(lr(10)) == pytest.approx(1.0)
  assert float(lr(79)) == pytest.approx(1.0)      # stable until the last 20 steps
  assert float(lr(90)) == pytest.approx(0.55)     # linear decay 1.0 → 0.1 over steps 80..100
  assert float(lr(100)) == pytest.approx(0.1)


def test_constant_schedule_points():
  lr = learning_rate_schedule(_cfg("lr_schedule=constant"))
  assert float(lr(5)) == pytest.approx(0.5)
  assert [float(lr(s)) for s in (10, 50, 100)] == [1.0, 1.0, 1.0]


def test_weight_decay_only_on_matrices_and_clipping():
  cfg = _cfg("lr_schedule=constant", "warmup_steps=0", "weight_decay=0.5", "max_grad_norm=1.0",
             "learning_rate=0.1")
  axes = {"w": ("embed", "mlp"), "scale": ("norm",), "stacked": ("layers", "norm"),
          "stacked_w": ("layers", "embed", "mlp")}
  tx = make_optimizer(cfg, axes)
  ones = lambda *shape: np.ones(shape, np.float32)
  params = {"w": ones(2, 2), "scale": ones(2), "stacked": ones(3, 2), "stacked_w": ones(3, 2, 2)}
  zero = jax.tree.map(np.zeros_like, params)
  # init and update each one program (eagerly every op of the chain compiles alone)
  updates, _ = jax.jit(tx.update)(zero, jax.jit(tx.init)(params), params)
  np.testing.assert_allclose(updates["w"], -0.1 * 0.5 * np.ones((2, 2)), rtol=1e-6)  # decayed
  np.testing.assert_allclose(updates["stacked_w"], -0.05 * np.ones((3, 2, 2)), rtol=1e-6)
  np.testing.assert_array_equal(updates["scale"], np.zeros(2))                       # not decayed
  np.testing.assert_array_equal(updates["stacked"], np.zeros((3, 2)))   # a stack of norm scales
  # a huge gradient is clipped to norm 1 before Adam; Adam's first step is then ±lr per entry
  big = {"w": np.full((2, 2), 1e6, np.float32), "scale": np.zeros((2,), np.float32)}
  cfg2 = _cfg("lr_schedule=constant", "warmup_steps=0", "weight_decay=0.0", "learning_rate=0.1")
  params = {"w": params["w"], "scale": params["scale"]}
  tx2 = make_optimizer(cfg2, {"w": axes["w"], "scale": axes["scale"]})
  updates, _ = jax.jit(tx2.update)(big, jax.jit(tx2.init)(params), params)
  np.testing.assert_allclose(updates["w"], -0.1 * np.ones((2, 2)), rtol=1e-4)


def test_cross_entropy_masks_padding_and_matches_numpy():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(2, 5, 7)).astype(np.float32)
  targets = rng.integers(0, 7, size=(2, 5)).astype(np.int32)
  mask = np.array([[1, 1, 1, 0, 0], [1, 0, 1, 1, 1]], bool)
  sums = jax.jit(cross_entropy_sums, static_argnums=3)   # one program (eagerly: one an op)
  nll, z, n = sums(logits, targets, mask, 1e-2)
  lse = np.log(np.exp(logits.astype(np.float64)).sum(-1))
  picked = np.take_along_axis(logits, targets[..., None], -1)[..., 0]
  want_z = (1e-2 * lse ** 2 * mask).sum()
  assert float(n) == mask.sum()
  assert float(z) == pytest.approx(want_z, rel=1e-5)
  assert float(nll) == pytest.approx(((lse - picked) * mask).sum() + want_z, rel=1e-5)
  # a masked position can hold anything without changing the loss
  logits[0, 4] += 100.0
  nll2, _, _ = sums(logits, targets, mask, 1e-2)
  assert float(nll2) == pytest.approx(float(nll), rel=1e-6)


def test_frozen_parameters_stay_bitwise_unchanged():
  """A family's frozen parameters (a carried MTP block) keep every bit, signed zeros included,
  under gradients, clipping and decoupled weight decay; the others train."""
  axes = {"w": ("embed", "mlp"), "mtp": {"w": ("embed", "mlp"), "scale": ("norm",)}}
  f32 = lambda x: np.array(x, np.float32)
  params = {"w": np.ones((3, 4), np.float32),
            "mtp": {"w": f32([[-0.0, 1.5, -2.0, 0.0]] * 3), "scale": f32([-0.0, 3.0])}}
  tx = make_optimizer(_cfg("weight_decay=0.1", "warmup_steps=0"), axes, frozen=("mtp",))
  state = jax.jit(tx.init)(params)
  grads = jax.tree.map(lambda p: np.full_like(p, 0.5), params)

  @jax.jit   # the step as training runs it: one program (eagerly every op compiles alone)
  def step(params, state):
    updates, state = tx.update(grads, state, params)
    return jax.tree.map(lambda p, u: p + u, params, updates), state
  for _ in range(2):
    params, state = step(params, state)
  assert np.asarray(params["mtp"]["w"]).tobytes() == f32([[-0.0, 1.5, -2.0, 0.0]] * 3).tobytes()
  assert np.asarray(params["mtp"]["scale"]).tobytes() == f32([-0.0, 3.0]).tobytes()
  assert not np.allclose(np.asarray(params["w"]), 1.0)
