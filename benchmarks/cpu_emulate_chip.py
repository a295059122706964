"""Emulate the chip's float32 errors on the CPU: how sensitive is each family's first gradient to
small relative errors in single primitives (the TPU's transcendentals are ~5.5e-6 (exp, log) and
~8e-5 (tanh) off in relative terms where the CPU's are ~1e-7: benchmarks/tpu_diag_precision.py)?

`perturbed({"exp": 5.5e-6, ...})` re-registers the MLIR lowering of each named primitive with a rule
that emits the original lowering's value y and returns y + y * eps * r, where r in [-1, 1) is a
deterministic pseudo-random function of y's bits (an integer hash; `mode="bias"`: r = 1, a
systematic error). Being a lowering rule it applies wherever the primitive is lowered: inside scans,
remat, custom_vjp rules, lower_fun-built rules. While a patched rule lowers its exact value (and
its perturbation) every patched rule lowers exactly, so e.g. `logistic` (which jax lowers through
exp and div on every platform) is perturbed once, by its own eps, not again through exp's. The
caches are cleared on entry and exit, so a jitted function re-lowers under the patch and after it.

  JAX_PLATFORMS=cpu python3 benchmarks/cpu_emulate_chip.py [--eps exp=5.5e-6,tanh=8e-5,...]
      [--mode hash|bias] [--seed N] [--where FILE:LINE] [--sites] [--attribute] [--roundoff]
      "" "model_name=gemma4-tiny" ...

Each positional argument is one variant (its keys, one string; "" is base.yml's model), over
tests/test_tpu.py's EXACT keys, the same as benchmarks/tpu_diag_grads.py's. One JSON line per
variant and perturbation: the loss's relative difference and the ten worst per-array relative
differences of the gradient against the exact CPU one. `--attribute` adds a line per primitive the
gradient's program uses, perturbed alone at its eps; `--roundoff` adds dot_general, div, add, mul
and reduce_sum perturbed at 1.2e-7 (one float32 ulp, alone each: float32 rounding's own size).
`--where` perturbs only the ops whose site (the innermost two frames of their traceback in this
repository, "MaxText/layers/norms.py:40 < MaxText/models/gemma4/model.py:283") contains it;
`--sites` lists the sites of the perturbed ops (a row's "sites": primitive, site, count).
"""
import argparse
import contextlib
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

# the chip's measured relative errors (benchmarks/tpu_diag_precision.py, RESULTS "Where float32
# differs on the chip"): exp/log ~5.5e-6, tanh ~8e-5; the other transcendentals taken as exp's.
# Not pow (`--eps pow=5.5e-6` adds it): RoPE's frequencies are theta ** (i / E), and pow at 5.5e-6
# alone moves llama's first gradient by 9e-5 (an error in a frequency grows with the position)
# where the chip's agrees with the CPU's to ~1e-6, so the chip's pow is far better than that there.
CHIP_EPS = {"exp": 5.5e-6, "exp2": 5.5e-6, "log": 5.5e-6, "log1p": 5.5e-6, "expm1": 5.5e-6,
            "tanh": 8e-5, "logistic": 5.5e-6, "rsqrt": 5.5e-6, "sqrt": 5.5e-6, "sin": 5.5e-6,
            "cos": 5.5e-6, "erf": 5.5e-6}
ROUNDOFF_EPS = {"dot_general": 1.2e-7, "div": 1.2e-7, "add": 1.2e-7, "mul": 1.2e-7,
                "reduce_sum": 1.2e-7}
OTHER = ("pow",)


def _primitives() -> dict:
  from jax import lax
  return {"exp": lax.exp_p, "exp2": lax.exp2_p, "log": lax.log_p, "log1p": lax.log1p_p,
          "expm1": lax.expm1_p, "tanh": lax.tanh_p, "logistic": lax.logistic_p,
          "rsqrt": lax.rsqrt_p, "sqrt": lax.sqrt_p, "sin": lax.sin_p, "cos": lax.cos_p,
          "erf": lax.erf_p, "pow": lax.pow_p, "dot_general": lax.dot_general_p,
          "div": lax.div_p, "add": lax.add_p, "mul": lax.mul_p, "reduce_sum": lax.reduce_sum_p}


PRIMITIVES = tuple(CHIP_EPS) + tuple(ROUNDOFF_EPS) + OTHER
_SALT = {name: 0x9E3779B1 * (i + 1) & 0xFFFFFFFF for i, name in enumerate(PRIMITIVES)}
_EXACT = [0]  # > 0 while a patched rule lowers its exact value or its perturbation


def unit_noise(y, salt: int):
  """r in [-1, 1): a hash (murmur3's finaliser) of y's float32 bits and `salt`, as float32."""
  import jax.numpy as jnp
  from jax import lax
  h = lax.bitcast_convert_type(y.astype(jnp.float32), jnp.uint32) ^ jnp.uint32(salt)
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  h = h ^ (h >> 16)
  return (h >> 8).astype(jnp.float32) * jnp.float32(2.0 ** -23) - jnp.float32(1.0)


def op_site(ctx) -> str:
  """Where an op comes from: the innermost two frames of its traceback in this repository
  ("MaxText/layers/norms.py:40 < MaxText/models/gemma4/model.py:283"), "" when it has none."""
  tb = ctx.traceback
  frames = [f"{os.path.relpath(f.file_name, ROOT)}:{f.line_num}" for f in (tb.frames if tb else ())
            if f.file_name.startswith(ROOT + os.sep) and "site-packages" not in f.file_name
            and f.file_name != os.path.abspath(__file__)]
  return " < ".join(frames[:2])


def _perturb_rule(original, name: str, eps: float, mode: str, where: str | None, sites: dict | None,
                  seed: int):
  import jax.numpy as jnp
  from MaxText.backend.compat import jax_mlir
  mlir = jax_mlir()

  def perturb(y):
    if not jnp.issubdtype(y.dtype, jnp.floating):
      return y
    r = unit_noise(y, _SALT[name] ^ seed) if mode == "hash" else jnp.ones(y.shape, jnp.float32)
    y32 = y.astype(jnp.float32)
    return (y32 + y32 * (jnp.float32(eps) * r)).astype(y.dtype)
  lowered_perturb = mlir.lower_fun(perturb, multiple_results=False)

  def rule(ctx, *args, **params):
    _EXACT[0] += 1
    try:
      outs = original(ctx, *args, **params)
      if _EXACT[0] > 1 or len(ctx.avals_out) != 1:
        return outs
      site = op_site(ctx) if where is not None or sites is not None else ""
      if sites is not None:
        sites[(name, site)] = sites.get((name, site), 0) + 1
      if where is not None and where not in site:
        return outs
      y = outs[0]
      if isinstance(y, (list, tuple)):
        if len(y) != 1:
          return outs
        y = y[0]
      aval = ctx.avals_out[0]
      sub = ctx.replace(primitive=None, avals_in=[aval], avals_out=[aval], tokens_out=None)
      return lowered_perturb(sub, y)
    finally:
      _EXACT[0] -= 1
  return rule


@contextlib.contextmanager
def perturbed(eps: dict, mode: str = "hash", where: str | None = None, sites: dict | None = None,
              seed: int = 0):
  """Within: each primitive named in `eps` (keys of PRIMITIVES) lowers to its exact value times
  (1 + eps * r) (module docstring); with `where`, only the ops whose `op_site` contains it. `sites`
  (a dict) counts the patched ops lowered by (primitive, op_site): where each comes from. `seed`
  (an int below 2**32) draws another noise pattern. The
  patched primitives are lowered uncached (jax caches a primitive's lowering per module and
  shape: an exact lowering inside another's would otherwise stand for the perturbed one). On exit
  the original rules are back. Clears JAX's caches on entry and exit."""
  import jax
  from MaxText.backend.compat import jax_mlir
  mlir = jax_mlir()
  if mode not in ("hash", "bias"):
    raise ValueError(f"mode: 'hash' or 'bias', not {mode!r}")
  unknown = sorted(set(eps) - set(PRIMITIVES))
  if unknown:
    raise ValueError(f"eps: unknown primitive(s) {unknown}; known: {', '.join(PRIMITIVES)}")
  prims = _primitives()
  saved, uncached = [], []
  try:
    for name, e in eps.items():
      if not e:
        continue
      prim = prims[name]
      if prim not in mlir._uncacheable_primitives:
        mlir._uncacheable_primitives.add(prim)
        uncached.append(prim)
      for table in (mlir._lowerings, mlir._platform_specific_lowerings["cpu"]):
        if prim in table:
          entry = table[prim]
          saved.append((table, prim, entry))
          table[prim] = mlir.LoweringRuleEntry(
              _perturb_rule(entry.rule, name, float(e), mode, where, sites, seed), entry.inline)
    jax.clear_caches()
    yield
  finally:
    for table, prim, entry in reversed(saved):
      table[prim] = entry
    for prim in uncached:
      mlir._uncacheable_primitives.discard(prim)
    jax.clear_caches()


def used_primitives(fn, *args) -> set:
  """The names (of PRIMITIVES) of the primitives `fn(*args)`'s jaxpr uses, nested jaxprs included."""
  import jax
  from MaxText.backend.compat import jaxprs_in_params
  names = {p: n for n, p in _primitives().items()}
  found = set()

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive in names:
        found.add(names[eqn.primitive])
      for sub in jaxprs_in_params(eqn.params):
        walk(sub)
  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


def parse_eps(text: str) -> dict:
  out = {}
  for part in filter(None, text.split(",")):
    name, _, value = part.partition("=")
    if name not in PRIMITIVES:
      raise SystemExit(f"--eps: unknown primitive {name!r}; known: {', '.join(PRIMITIVES)}")
    try:
      out[name] = float(value)
    except ValueError:
      raise SystemExit(f"--eps: {name}={value!r} is not a number") from None
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("variants", nargs="*", default=[""])
  ap.add_argument("--eps", default="", help="name=eps,...: replaces the chip's defaults")
  ap.add_argument("--mode", default="hash", choices=("hash", "bias"))
  ap.add_argument("--seed", type=int, default=0, help="another noise pattern")
  ap.add_argument("--where", default=None, help="perturb only the ops whose site (file:line < "
                  "file:line, the innermost two of this repository) contains this")
  ap.add_argument("--sites", action="store_true", help="list the perturbed ops' sites")
  ap.add_argument("--attribute", action="store_true", help="also each used primitive alone")
  ap.add_argument("--roundoff", action="store_true", help="also dot_general/div/add/mul/"
                  "reduce_sum alone at one float32 ulp")
  a = ap.parse_args(argv)
  if not 0 <= a.seed < 2 ** 32:
    raise SystemExit(f"--seed: {a.seed} is not in [0, 2**32)")
  import jax
  from tpu_diag_grads import leaf_errors, setup
  chip = parse_eps(a.eps) if a.eps else dict(CHIP_EPS)
  for variant in a.variants:
    fn, params, batch = setup(variant)
    used = used_primitives(fn, params, batch)
    l0, g0 = fn(params, batch)
    l0, g0 = float(l0), jax.tree.map(np.asarray, g0)
    runs = [("chip", {k: v for k, v in chip.items() if k in used and v})]
    if a.attribute:
      runs += [(k, {k: v}) for k, v in chip.items() if k in used and v]
    if a.roundoff:
      runs += [(k, {k: v}) for k, v in ROUNDOFF_EPS.items() if k in used]
    for label, eps in runs:
      sites = {} if a.sites or a.where else None
      with perturbed(eps, a.mode, a.where, sites, a.seed):
        l1, g1 = fn(params, batch)
      if a.where and eps and not any(a.where in site for _, site in sites or {}):
        # a stale FILE:LINE would otherwise print an unperturbed gradient as the answer
        raise SystemExit(f"--where {a.where!r}: no op of {sorted(eps)} comes from there; "
                         f"their sites: {sorted({st for _, st in sites or {}})}")
      errs = leaf_errors(jax.tree.map(np.asarray, g1), g0)
      worst = sorted(errs.items(), key=lambda kv: -kv[1])[:10]
      top = max(eps.values()) if eps else 0.0
      row = {"variant": variant, "perturbed": label, "eps": eps, "mode": a.mode, "seed": a.seed,
             "where": a.where, "loss_rel": abs(float(l1) - l0) / abs(l0),
             "grad_rel_max": worst[0][1], "amplification": worst[0][1] / top if top else None,
             "worst_leaves": worst}
      if a.sites and sites is not None:
        row["sites"] = sorted(f"{n} {s or '?'} x{c}" for (n, s), c in sites.items())
      print(json.dumps(row), flush=True)


if __name__ == "__main__":
  main()
