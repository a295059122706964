"""Where float32 differs on a TPU: matmul precision (XLA's dot and a Pallas kernel's, with and
without `highest`) and the elementwise transcendentals (exp, tanh, log, rsqrt, erf, gelu) against
the CPU and float64. One JSON line per check; runs on the CPU too (the Pallas kernel interpreted).

  JAX_PLATFORMS=tpu,cpu python3 benchmarks/tpu_diag_precision.py
"""
import json
import numpy as np
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

def rel(a, b):
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))

def out(**kw):
  print(json.dumps(kw), flush=True)

rng = np.random.default_rng(0)
a = rng.standard_normal((256, 256)).astype(np.float32)
b = rng.standard_normal((256, 256)).astype(np.float32)
ref = a.astype(np.float64) @ b.astype(np.float64)
for prec in (None, jax.lax.Precision.HIGHEST):
  def kern(x_ref, y_ref, o_ref, prec=prec):
    o_ref[...] = jax.lax.dot_general(x_ref[...], y_ref[...], (((1,), (0,)), ((), ())),
                                     precision=prec, preferred_element_type=jnp.float32)
  f = pl.pallas_call(kern, out_shape=jax.ShapeDtypeStruct((256, 256), jnp.float32),
                     interpret=jax.default_backend() == "cpu")
  out(check="pallas dot", precision=str(prec), rel=rel(jax.jit(f)(a, b), ref))
  with jax.default_matmul_precision("highest"):
    out(check="pallas dot in highest ctx", precision=str(prec), rel=rel(jax.jit(f)(a, b), ref))
for p in ("default", "high", "highest"):
  out(check="xla dot", precision=p, rel=rel(jnp.dot(a, b, precision=p), ref))
x = np.linspace(-20, 20, 1 << 16).astype(np.float32)
for name, fn, npf in (("exp", jnp.exp, np.exp), ("tanh", jnp.tanh, np.tanh),
                      ("log", lambda v: jnp.log(jnp.abs(v) + 1e-3), lambda v: np.log(np.abs(v) + 1e-3)),
                      ("rsqrt", lambda v: jax.lax.rsqrt(jnp.abs(v) + 1e-3), lambda v: 1 / np.sqrt(np.abs(v) + 1e-3)),
                      ("erf", jax.scipy.special.erf, None),
                      ("gelu_tanh", lambda v: jax.nn.gelu(v, approximate=True), None)):
  got = np.asarray(jax.jit(fn)(x), np.float64)
  with jax.default_device(jax.devices("cpu")[0]):
    cpu = np.asarray(jax.jit(fn)(x), np.float64)
  r = {"check": f"elementwise {name}", "tpu_vs_cpu_max_rel": float(np.max(np.abs(got - cpu) / np.maximum(np.abs(cpu), 1e-30)))}
  if npf is not None:
    want = npf(x.astype(np.float64))
    r["tpu_vs_f64_max_rel"] = float(np.max(np.abs(got - want) / np.maximum(np.abs(want), 1e-30)))
    r["cpu_vs_f64_max_rel"] = float(np.max(np.abs(cpu - want) / np.maximum(np.abs(want), 1e-30)))
  out(**r)
# softmax / logsumexp over 1024
s = rng.standard_normal((64, 1024)).astype(np.float32) * 5
got = np.asarray(jax.jit(jax.nn.logsumexp, static_argnames="axis")(s, axis=-1), np.float64)
want = np.log(np.sum(np.exp(s.astype(np.float64)), -1))
out(check="logsumexp 1024", rel=rel(got, want))
# exp inside a Pallas (Mosaic) kernel vs XLA's, over attention's range
xs = np.linspace(-30, 0, 8 * 128 * 64).astype(np.float32).reshape(-1, 128)
def ekern(x_ref, o_ref):
  o_ref[...] = jnp.exp(x_ref[...])
pe = pl.pallas_call(ekern, out_shape=jax.ShapeDtypeStruct(xs.shape, jnp.float32),
                    interpret=jax.default_backend() == "cpu")
want = np.exp(xs.astype(np.float64))
for name, got in (("pallas exp", jax.jit(pe)(xs)), ("xla exp", jax.jit(jnp.exp)(xs))):
  g = np.asarray(got, np.float64)
  out(check=name, max_rel=float(np.max(np.abs(g - want) / want)),
      mean_rel=float(np.mean(np.abs(g - want) / want)))
# the derivatives the chip's first gradients of Gemma 4 / Qwen3-Next go through (gelu_tanh, tanh,
# softplus, sigmoid, exp), against float64; beside them tanh with a derivative that does not
# cancel where |tanh| -> 1 (sech^2 = 4e / (1 + e)^2, e = exp(-2|x|)): a candidate fix, measured
@jax.custom_jvp
def stable_tanh(v):
  return jnp.tanh(v)


@stable_tanh.defjvp
def _stable_tanh_jvp(primals, tangents):
  (v,), (dv,) = primals, tangents
  t = jnp.tanh(v)
  e = jnp.exp(-2 * jnp.abs(v))
  return t, dv * jnp.where(jnp.abs(v) < 0.5, 1 - t * t, 4 * e / ((1 + e) * (1 + e)))


xg = np.linspace(-12, 12, 1 << 16).astype(np.float32)
x64 = xg.astype(np.float64)
cg = np.sqrt(2 / np.pi)
ug = cg * (x64 + 0.044715 * x64 ** 3)
sech2 = 1 / np.cosh(ug) ** 2
derivs = {
    "tanh'": (jnp.tanh, 1 / np.cosh(x64) ** 2),
    "stable tanh'": (stable_tanh, 1 / np.cosh(x64) ** 2),
    "gelu_tanh'": (lambda v: jax.nn.gelu(v, approximate=True),
                   0.5 * (1 + np.tanh(ug)) + 0.5 * x64 * sech2 * cg * (1 + 3 * 0.044715 * x64 ** 2)),
    "stable gelu_tanh'": (lambda v: v * (0.5 * (1.0 + stable_tanh(np.float32(cg) * (v + 0.044715 * v ** 3)))),
                          0.5 * (1 + np.tanh(ug)) + 0.5 * x64 * sech2 * cg * (1 + 3 * 0.044715 * x64 ** 2)),
    "softplus'": (jax.nn.softplus, 1 / (1 + np.exp(-x64))),
    "sigmoid'": (jax.nn.sigmoid, np.exp(-x64) / (1 + np.exp(-x64)) ** 2),
    "exp(-exp(x))'": (lambda v: jnp.exp(-jnp.exp(v)), -np.exp(x64) * np.exp(-np.exp(x64))),
}
for name, (fn, want) in derivs.items():
  got = np.asarray(jax.jit(jax.vmap(jax.grad(fn)))(xg), np.float64)
  err = np.abs(got - want)
  out(check=f"derivative {name}", max_rel_of_max=float(err.max() / np.abs(want).max()),
      worst_x=float(x64[err.argmax()]),
      max_rel_where_above_1em3=float(np.max(np.where(np.abs(want) > 1e-3,
                                                     err / np.maximum(np.abs(want), 1e-30), 0))))
