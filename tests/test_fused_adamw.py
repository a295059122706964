"""The fused AdamW (`Optimizer.apply`, train/optimizer.py) against optax's chain as the oracle:
clip → AdamW (masked weight decay, schedule) → freeze → apply_updates → the non-finite guard, bit
for bit over several steps (fp32 and bf16 parameters, a skipped non-finite step, frozen leaves,
clipping on and off), with the same state structure; each compiled with the users' fusion emitters
(tests/conftest.py). With mixed dtypes too — bf16 parameters with float32 gradients (the train
step's: divided by the float32 token count) and moments in bf16 (`moment_dtype=auto`) or float32,
float32 parameters with bf16 moments — where the state keeps its declared dtypes step after step."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import BASE_YML, USERS_EMITTERS
from MaxText.config.load import load_config
from MaxText.train.optimizer import make_optimizer, through_stored
from optax_oracle import chain_apply

AXES = {"w": ("layers", "embed", "mlp"), "scale": ("layers", "norm"), "emb": ("vocab", "embed"),
        "mtp": {"w": ("embed", "mlp"), "scale": ("norm",)}}


def _cfg(*over):
  return load_config([BASE_YML, "steps=20", "warmup_steps=3", "learning_rate=0.05",
                      "weight_decay=0.1", *over])


def _params(dtype):
  """Host arrays (drawn with NumPy: eager jax draws and casts compile a program each)."""
  rng = np.random.default_rng(0)
  r = lambda shape: rng.normal(size=shape).astype(np.float32).astype(dtype)
  return {"w": r((2, 8, 16)), "scale": r((2, 8)), "emb": r((32, 8)),
          "mtp": {"w": r((8, 16)), "scale": np.array([-0.0] * 4 + [1.0] * 4, dtype)}}


def _grads(params, step, dtype=None):
  """Gradients in `dtype` (None: each parameter's)."""
  scale = 3.0 if step % 2 else 0.01   # alternately clipped and not
  rng = np.random.default_rng(100 + step)
  g = jax.tree.map(lambda p: (scale * rng.normal(size=p.shape).astype(np.float32)
                              ).astype(dtype or p.dtype), params)
  if step == 2:   # a non-finite step: nothing may change, neither count advances
    g["emb"][0, 0] = np.nan
  return g


def _bits(tree):
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("dtype,clip,grad_dtype,moments", [
    (jnp.float32, "1.0", None, "auto"), (jnp.bfloat16, "1.0", None, "auto"),
    (jnp.float32, "0", None, "auto"), (jnp.bfloat16, "1.0", jnp.float32, "auto"),
    (jnp.bfloat16, "1.0", jnp.float32, "float32"), (jnp.float32, "1.0", None, "bfloat16")])
def test_fused_adamw_is_optax_bit_for_bit(dtype, clip, grad_dtype, moments):
  weights = jnp.dtype(dtype).name
  opt = make_optimizer(_cfg(f"max_grad_norm={clip}", f"weight_dtype={weights}",
                            f"moment_dtype={moments}"), AXES, frozen=("mtp",))
  declared = jnp.dtype(weights if moments == "auto" else moments)
  assert opt.moment_dtype == declared

  @functools.partial(jax.jit, compiler_options=USERS_EMITTERS)
  def oracle(grads, state, params):
    norm = optax.tree.norm(grads)
    return chain_apply(opt.update)(grads, state, params, norm, jnp.isfinite(norm))

  @functools.partial(jax.jit, compiler_options=USERS_EMITTERS)
  def fused(grads, state, params):
    norm = optax.tree.norm(grads)
    return opt.apply(grads, state, params, norm, jnp.isfinite(norm))

  @functools.partial(jax.jit, compiler_options=USERS_EMITTERS)
  def fused_zero(grads, state, params):   # ZeRO-1's form: whole + gather(guarded update)
    norm = optax.tree.norm(grads)
    return opt.apply(grads, state, params, norm, jnp.isfinite(norm), whole=params,
                     gather=lambda tree: tree)

  p_ref = p_new = p_zero = _params(dtype)
  s_ref = s_new = s_zero = jax.jit(opt.init)(p_ref)   # one program (eagerly: one per leaf)
  state_dtypes = [x.dtype for x in jax.tree.leaves(s_ref)]
  assert {x.dtype for x in jax.tree.leaves(s_ref) if np.ndim(x)} == {declared}   # mu and nu
  for step in range(5):
    g = _grads(p_ref, step, grad_dtype)
    p_ref, s_ref = oracle(g, s_ref, p_ref)
    p_new, s_new = fused(g, s_new, p_new)
    p_zero, s_zero = fused_zero(g, s_zero, p_zero)
    assert jax.tree.structure(s_new) == jax.tree.structure(s_ref)
    assert _bits(p_new) == _bits(p_ref) == _bits(p_zero), step
    assert _bits(s_new) == _bits(s_ref) == _bits(s_zero), step
    assert [x.dtype for x in jax.tree.leaves(s_new)] == state_dtypes   # declared, kept
    assert [x.dtype for x in jax.tree.leaves(s_zero)] == state_dtypes
    assert {x.dtype for x in jax.tree.leaves(p_new)} == {jnp.dtype(dtype)}
  counts = [int(c) for c in jax.tree.leaves(s_new) if np.ndim(c) == 0]
  assert counts and all(c == 4 for c in counts)   # 5 steps, one skipped
  assert _bits(p_new["mtp"]) == _bits(_params(dtype)["mtp"])   # frozen: every bit kept
  assert _bits(p_new["w"]) != _bits(_params(dtype)["w"])


def test_through_stored_is_the_value_bit_for_bit():
  """The update reads each moment through its stored (narrower) copy: the value it reads must be
  the unrounded one bit for bit, for every input — signed zeros, subnormals (the CPU compares
  them as zeros: bits are compared, not values), a value bf16 overflows on, infinities, NaN."""
  value = np.array([0.0, -0.0, 1e-40, -3e-39, 1.0 + 2**-10, -3.14159, 3.3999e38, -3.4e38, np.inf,
                    -np.inf, np.nan, 1e-30], np.float32)

  @functools.partial(jax.jit, compiler_options=USERS_EMITTERS)
  def read(x):
    stored = x.astype(jnp.bfloat16)
    return through_stored(stored, x), through_stored(stored, stored), stored.astype(x.dtype)

  got, same_dtype, rounded = (np.asarray(a) for a in read(value))
  assert got.dtype == np.float32 and got.tobytes() == value.tobytes()
  assert same_dtype.dtype == jnp.bfloat16
  assert rounded.tobytes() != value.tobytes()   # the stored copy alone is not the value
