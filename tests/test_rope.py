"""RoPE's two mechanisms (`MaxText/layers/rope.py`): the tuned path's rotation (the two halves
sliced, rotated and concatenated, with the custom VJP `_rotate_bwd`) and the plain path's
`rotate_by_swap_matmul` (x·[cos, cos] + (x @ P)·[−sin, sin], P `swap_halves_matrix`, its gradient
by autodiff) give the same bits, forward and backward, in bfloat16 and float32: `apply_rope` whole
and Gemma 4's proportional fraction, `apply_partial_rope`, head dims 128 and 64, odd head counts.
A float64 NumPy rotation is the oracle of what both compute; NumPy indexing is the oracle of the
swap matrix."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.backend import hot_path
from MaxText.layers import rope

B, S, THETA = 2, 16, 10000.0
# row 1 starts further on (a packed document's later positions): angles up to ~250 rad
POSITIONS = np.stack([np.arange(S), 100 + 9 * np.arange(S)]).astype(np.int32)


def _rope(x, fraction, rotary_dim):
  positions = jnp.asarray(POSITIONS)      # traced: a constant of the program
  if rotary_dim:
    return rope.apply_partial_rope(x, positions, THETA, rotary_dim)
  return rope.apply_rope(x, positions, THETA, fraction)


def _forward_and_vjp(path, x, g, fraction, rotary_dim):
  """(rope(x), the x cotangent of g) on `path`, one jitted program; and the jaxprs of the forward
  alone and of the program."""
  def forward(x_):
    return _rope(x_, fraction, rotary_dim)

  def f(x_, g_):
    y, pullback = jax.vjp(forward, x_)
    return y, pullback(g_)[0]
  with hot_path.use(path):
    jaxprs = str(jax.make_jaxpr(forward)(x)), str(jax.make_jaxpr(f)(x, g))
    y, dx = jax.jit(f)(x, g)
  return np.asarray(y), np.asarray(dx), jaxprs


def _reference(x, g, E, fraction, rotary_dim):
  """float64 (rotation of x, its transpose applied to g): channel i < R/2 paired with i + R/2 over
  the first R channels (R = rotary_dim, else E), angle position · θ^(−2i/W) (W = R; Gemma 4's
  fraction: W = E with the pairs from fraction·E/2 on at angle 0); the other channels as they are."""
  R = rotary_dim or E
  i = np.arange(R // 2)
  inv = THETA ** (-2.0 * i / R)
  if fraction < 1.0:
    inv = np.where(i < int(fraction * E // 2), inv, 0.0)
  angle = POSITIONS[..., None].astype(np.float64) * inv              # [B, S, R/2]
  cos, sin = np.cos(angle)[:, :, None], np.sin(angle)[:, :, None]

  def rotate(v, s):
    v = v.astype(np.float64)
    v1, v2, rest = v[..., :R // 2], v[..., R // 2:R], v[..., R:]
    return np.concatenate([v1 * cos - v2 * s, v2 * cos + v1 * s, rest], axis=-1)
  return rotate(x, sin), rotate(g, -sin)


CASES = [(128, 3, 1.0, 0), (64, 5, 1.0, 0),
         (128, 3, 0.25, 0),        # Gemma 4's proportional RoPE: 16 of 64 pairs rotate
         (128, 5, 1.0, 32)]        # Hugging Face's partial_rotary_factor 0.25
# float64 oracle's tolerance, on inputs of unit scale: fp32 (sin/cos of fp32 angles: |angle| ≲ 250
# rad at 2^-24 relative, plus the products' roundings); bf16 (cos/sin rounded to bf16, each
# product and the sum rounded: a few 2^-9 of the operands)
ATOL = {jnp.float32: 1e-4, jnp.bfloat16: 4 * 2.0 ** -9 * 4}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("E,H,fraction,rotary_dim", CASES,
                         ids=["E128-H3", "E64-H5", "E128-H3-fraction0.25", "E128-H5-rotary32"])
def test_plain_swap_matmul_gives_the_tuned_bits(dtype, E, H, fraction, rotary_dim):
  rng = np.random.default_rng(E + H)
  x = rng.standard_normal((B, S, H, E)).astype(dtype)       # host arrays (ml_dtypes for bf16)
  g = rng.standard_normal((B, S, H, E)).astype(dtype)
  y_t, dx_t, jaxpr_t = _forward_and_vjp("tuned", x, g, fraction, rotary_dim)
  y_p, dx_p, jaxpr_p = _forward_and_vjp("plain", x, g, fraction, rotary_dim)
  # two mechanisms: the tuned one's custom VJP and no matmul; the plain one's swap matmul (and
  # its transpose in the backward pass), no custom VJP
  assert "custom_vjp_call" in jaxpr_t[0] and "dot_general" not in jaxpr_t[1]
  assert "custom_vjp_call" not in jaxpr_p[0] and jaxpr_p[0].count("dot_general") == 1
  assert jaxpr_p[1].count("dot_general") == 2
  assert y_p.dtype == y_t.dtype == dx_p.dtype == dx_t.dtype == np.dtype(dtype)
  bits = np.uint16 if dtype == jnp.bfloat16 else np.uint32
  np.testing.assert_array_equal(y_p.view(bits), y_t.view(bits), err_msg="forward")
  np.testing.assert_array_equal(dx_p.view(bits), dx_t.view(bits), err_msg="x cotangent")
  want_y, want_dx = _reference(x, g, E, fraction, rotary_dim)
  np.testing.assert_allclose(y_p.astype(np.float64), want_y, rtol=0, atol=ATOL[dtype])
  np.testing.assert_allclose(dx_p.astype(np.float64), want_dx, rtol=0, atol=ATOL[dtype])
  # the channels past the rotation pass through unchanged (both directions)
  R = rotary_dim or E
  still = np.zeros(E, bool)
  still[R:] = True
  if fraction < 1.0:
    rotated = int(fraction * E // 2)
    still[rotated:E // 2] = still[E // 2 + rotated:] = True
  np.testing.assert_array_equal(y_p[..., still].view(bits), x[..., still].view(bits))
  np.testing.assert_array_equal(dx_p[..., still].view(bits), g[..., still].view(bits))


@pytest.mark.parametrize("E,dtype", [(64, jnp.float32), (128, jnp.float32), (128, jnp.bfloat16)])
def test_swap_halves_matrix_swaps_the_halves(E, dtype):
  P = np.asarray(jax.jit(rope.swap_halves_matrix, static_argnums=(0, 1))(E, dtype))
  assert P.shape == (E, E) and P.dtype == np.dtype(dtype)
  P = P.astype(np.float64)
  assert set(np.unique(P)) == {0.0, 1.0}
  assert (P.sum(0) == 1).all() and (P.sum(1) == 1).all()       # a permutation
  x = np.random.default_rng(0).standard_normal((3, 5, E))
  j = np.arange(E)
  np.testing.assert_array_equal(x @ P, x[..., (j + E // 2) % E])
