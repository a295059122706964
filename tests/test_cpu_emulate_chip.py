"""benchmarks/cpu_emulate_chip.py's perturbation does what it claims: inside `perturbed`, a patched
primitive's value is the exact one times (1 + eps * r), |r| <= 1, r nonzero for nearly every input
and centred; only the named primitives move (a decomposed one, logistic, is perturbed once); it
reaches a scan's body, a rematerialized block and a custom_vjp's backward; after the context the
exact lowering is back. The oracle: numpy's float64 and the same jitted program before the patch."""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import cpu_emulate_chip as emu  # noqa: E402

X = np.linspace(-8.0, 8.0, 20001).astype(np.float32)
EPS = 1e-4


def _rel(got, want):
  want = np.asarray(want, np.float64)
  return (np.asarray(got, np.float64) - want) / want


def test_exp_moves_by_at_most_eps_and_only_inside_the_context():
  f = jax.jit(jnp.exp)
  exact = np.asarray(f(X))
  exact_tanh = np.asarray(jax.jit(jnp.tanh)(X))
  with emu.perturbed({"exp": EPS}):
    got = np.asarray(f(X))              # the same jitted function: re-lowered under the patch
    tanh = np.asarray(jax.jit(jnp.tanh)(X))
  after = np.asarray(f(X))
  r = _rel(got, exact)
  # float32's own rounding of y + y*eps*r adds at most one ulp (1.2e-7) to eps
  assert np.max(np.abs(r)) <= EPS + 1.2e-7, np.max(np.abs(r))
  assert np.max(np.abs(r)) >= 0.9 * EPS                 # the noise spans its range
  assert np.mean(np.abs(r) > 1e-2 * EPS) > 0.95         # nearly every value moved
  assert abs(np.mean(r)) < 0.05 * EPS                   # centred: no systematic bias
  np.testing.assert_array_equal(tanh, exact_tanh)      # another primitive: untouched
  np.testing.assert_array_equal(after, exact)           # undone


def test_bias_mode_is_a_systematic_factor_and_logistic_is_perturbed_once():
  # against the exact float32 program: one rounding of y + y*eps each side (<= 2 ulp: 2.4e-7)
  tanh, sigmoid = jax.jit(jnp.tanh), jax.jit(jax.nn.sigmoid)
  x = X[X != 0]
  exact_t, exact_s = np.asarray(tanh(x)), np.asarray(sigmoid(x))
  with emu.perturbed({"tanh": EPS}, mode="bias"):
    t = np.asarray(tanh(x))
  np.testing.assert_allclose(_rel(t, exact_t), EPS, atol=2.5e-7)
  # jax lowers logistic through exp and div: patched with exp it moves by its own eps only
  with emu.perturbed({"logistic": EPS, "exp": 100 * EPS}, mode="bias"):
    s = np.asarray(sigmoid(x))
  np.testing.assert_allclose(_rel(s, exact_s), EPS, atol=2.5e-7)
  # exp alone reaches it through the decomposition: d log sigmoid = -(1 - sigmoid) d log exp(-x)
  with emu.perturbed({"exp": EPS}, mode="bias"):
    s = np.asarray(sigmoid(x))
  np.testing.assert_allclose(_rel(s, exact_s), -EPS * (1 - exact_s.astype(np.float64)), atol=2.5e-7)


def test_reaches_scan_remat_and_custom_vjp_backward():
  @jax.custom_vjp
  def f(x):
    return x * 2.0

  def f_fwd(x):
    return f(x), x

  def f_bwd(x, g):
    return (g * jnp.exp(x),)               # exp only in the backward rule
  f.defvjp(f_fwd, f_bwd)

  def body(c, x):
    return c + jax.checkpoint(lambda v: f(jnp.tanh(v)))(x), None

  def loss(xs):
    return jax.lax.scan(body, jnp.zeros((), jnp.float32), xs)[0]
  g = jax.jit(jax.grad(loss))
  xs = X[::100] / 4.0                       # |x| <= 2: tanh's derivative without cancellation
  exact = np.asarray(g(xs))
  want = np.exp(np.tanh(xs.astype(np.float64))) * (1 - np.tanh(xs.astype(np.float64)) ** 2)
  np.testing.assert_allclose(exact, want, rtol=2e-6)
  with emu.perturbed({"exp": EPS}, mode="bias"):
    got = np.asarray(g(xs))
  # the perturbed program fuses differently: its tanh derivative (1 - tanh^2, cancelling near
  # |x| = 2) rounds differently by up to ~1e-6 relative, a hundredth of EPS
  np.testing.assert_allclose(_rel(got, exact), EPS, atol=2e-6)
  np.testing.assert_array_equal(np.asarray(g(xs)), exact)


def test_dot_general_roundoff_and_used_primitives():
  a = np.ones((3, 5), np.float32)
  with emu.perturbed({"dot_general": 1e-3}, mode="bias"):
    d = np.asarray(jax.jit(jnp.dot)(a, a.T))
  np.testing.assert_allclose(d, 5.0 * (1 + 1e-3), rtol=1e-6)
  used = emu.used_primitives(jax.grad(lambda x: jnp.sum(jax.lax.scan(
      lambda c, v: (c + jnp.exp(v) * jax.lax.rsqrt(v * v + 1.0), None), 0.0, x)[0])), X[:4])
  assert {"exp", "rsqrt", "mul", "add"} <= used and "tanh" not in used and "log" not in used


def test_refuses_unknown_primitives_and_modes():
  with pytest.raises(ValueError, match="unknown primitive.*'sinh'"):
    with emu.perturbed({"sinh": 1e-3}):
      pass
  with pytest.raises(ValueError, match="mode"):
    with emu.perturbed({"exp": 1e-3}, mode="gauss"):
      pass
  with pytest.raises(SystemExit, match="--eps: unknown primitive 'sinh'"):
    emu.parse_eps("exp=1e-6,sinh=1e-3")
  with pytest.raises(SystemExit, match="exp='x'"):
    emu.parse_eps("exp=x")
  assert emu.parse_eps("exp=1e-6,tanh=8e-5") == {"exp": 1e-6, "tanh": 8e-5}


def test_a_nested_exact_lowering_does_not_stand_for_the_perturbed_one():
  # jax caches a primitive's lowering per module and shape: the exact exp inside logistic's
  # decomposition must not be reused for the standalone exp of the same shape (nor the reverse)
  f = jax.jit(lambda v: (jax.nn.sigmoid(v), jnp.exp(-v)))
  s0, e0 = map(np.asarray, f(X))
  with emu.perturbed({"logistic": EPS, "exp": 10 * EPS}, mode="bias"):
    s1, e1 = map(np.asarray, f(X))
  np.testing.assert_allclose(_rel(s1, s0), EPS, atol=2.5e-7)
  np.testing.assert_allclose(_rel(e1, e0), 10 * EPS, atol=2.5e-7)
  with emu.perturbed({"logistic": EPS}, mode="bias"):
    s1, e1 = map(np.asarray, f(X))
  np.testing.assert_array_equal(e1, e0)


def test_where_picks_ops_by_their_source_line_and_sites_lists_them():
  def two_exps(v):
    a = jnp.exp(v)                          # site A
    return a + jnp.exp(v * 0.5)             # site B
  line_a = two_exps.__code__.co_firstlineno + 1
  f = jax.jit(two_exps)
  exact = np.asarray(f(X))
  sites: dict = {}
  where = f"tests/test_cpu_emulate_chip.py:{line_a}"
  with emu.perturbed({"exp": EPS}, mode="bias", where=where, sites=sites):
    got = np.asarray(f(X))
  a = np.exp(X.astype(np.float64))
  want = (a * (1 + EPS) + np.exp(X.astype(np.float64) * 0.5)) / (a + np.exp(X.astype(np.float64) * 0.5))
  np.testing.assert_allclose(_rel(got, exact), want - 1, atol=3e-7)
  assert sorted(site.split(" < ")[0] for (_, site) in sites) == [
      where, f"tests/test_cpu_emulate_chip.py:{line_a + 1}"], sites


def test_the_command_reports_a_perturbed_gradient(capsys):
  # docs/performance.md's command, one variant and one primitive (two compiles of the gradient)
  emu.main(["model_name=qwen3-tiny", "--eps", "exp=1e-3", "--sites"])
  (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")]
  row = __import__("json").loads(line)
  assert row["variant"] == "model_name=qwen3-tiny" and row["eps"] == {"exp": 1e-3}
  errs = [e for _, e in row["worst_leaves"]]
  assert len(errs) == 10 and errs == sorted(errs, reverse=True)
  assert 0 < errs[0] == row["grad_rel_max"] < 1 and row["loss_rel"] < 1e-2
  # only exps; attention's softmax among them, found by its source line
  assert all(s.startswith("exp ") for s in row["sites"]), row["sites"]
  assert any(s.startswith("exp MaxText/layers/attention_ops.py:") for s in row["sites"]), row["sites"]
  # a --where no op comes from (a stale FILE:LINE in a command) is refused, not answered with
  # the exact gradient
  with pytest.raises(SystemExit, match="no op of \\['exp'\\] comes from there"):
    emu.main(["model_name=qwen3-tiny", "--eps", "exp=1e-3", "--where", "nowhere.py:1"])
