"""A model's float parameters → its integer-weight form (`layers/quant.py: IntWeights`), by RTN or
GPTQ (`quantization/gptq.py`), and back (dequantized floats, for `to_huggingface`).

Targets: the projections `layers/quant.targets` picks (the decoder's attention and MLP
projections; not the embedding, the head or routers) and the routed experts' wi / wo
(`layers/quant_experts.targets`), with `vocab` (`weight_quant_vocab`) also an untied LM head (a
projection) and the model's vocabulary tables (`layers/quant_vocab.tables`: the embedding — a tied
head's table — and Gemma's per-layer-input table), minus `weight_quant_exclude`. A table [V, D] is
quantized as the head's matrix [D, V] it is (one group: a scale per vocabulary row) by RTN, int8,
whatever the method (GPTQ has no Hessian of a lookup), in pieces of rows. A kernel [*lead, *in, *out] (lead:
the scanned stack's repeat axis; for experts also the expert axis) is quantized per lead index as
the 2-D matrix [prod(in), prod(out)] the model multiplies — so each expert on its own.

Hessians (GPTQ, and the per-layer output error of either method): one forward + backward per
calibration batch through the model (sharded over the mesh as in training) with `HessianProbe`s (the gradient of each zero probe is X^T X
of that projection's input over the batch's tokens), summed over batches and divided by the
token count — all from the full-precision model (not layer by layer through already-quantized
layers, as the GPTQ paper does). An expert's Hessian sums the token copies routed to it; an
expert that no calibration token reached (a zero Hessian) is quantized by RTN, and logged.
"""
from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass
from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from jax.sharding import Mesh
from tqdm import tqdm

from MaxText.layers import int_levels, quant, quant_experts, quant_vocab
from MaxText.models.model_config import ModelConfig
from MaxText.models.registry import make_model_def
from MaxText.sharding.rules import Rules, batch_sharding, tree_shardings, use_rules
from MaxText.quantization import gptq

Flat = dict[tuple, Any]


@dataclass(frozen=True)
class Target:
  name: str        # module path, "/" joined (routed experts: ".../experts/wi" and ".../wo")
  kernel: tuple    # the weight's key path in the parameter tree
  in_rank: int
  lead: int        # leading (stacked) axes of the kernel: the scan's repeats, the experts
  scale: tuple     # the key path of its scales in the integer form
  probe: str       # the name of its Hessian in `hessians`' result
  table: bool = False   # a vocabulary table [V, D]: int8 RTN, one scale per row (module docstring)

  @staticmethod
  def at(name: str, kernel: tuple, in_rank: int, lead: int, scale: str, probe: str,
         table: bool = False) -> "Target":
    return Target(name, kernel, in_rank, lead, (*kernel[:-1], scale),
                  "/".join(map(str, (*kernel[:-1], probe))), table)


def targets(mcfg: ModelConfig, exclude: str, vocab: bool = False) -> list[Target]:
  """The matrices quantized, with where their kernels live (`vocab`: the vocabulary tables and an
  untied head too)."""
  found = []

  def record(model):
    for name, dense in quant.targets(model, exclude, vocab):
      ndim = len(dense.kernel.get_value().shape)
      found.append((name, (*name.split("/"), "kernel"), dense.in_rank,
                    ndim - dense.in_rank - dense.out_rank, "kernel_scale", "hessian_probe"))
    for name, experts in quant_experts.targets(model, exclude):
      for w in quant_experts.WEIGHTS:
        ndim = len(getattr(experts, w).get_value().shape)
        found.append((f"{name}/{w}", (*name.split("/"), w), 1, ndim - 2, f"{w}_scale",
                      f"{w}_hessian_probe"))
    for name in quant_vocab.tables(model, exclude) if vocab else ():
      found.append((name, (name,), 1, 0, name + quant_vocab.SCALE, "", True))

  model_def = make_model_def(mcfg, modify=record)
  keys = {tuple(map(str, k)): k for k in traverse_util.flatten_dict(model_def.abstract_params)}
  return [Target.at(name, keys[path], *rest) for name, path, *rest in found]


def hessian_inputs(tgts: list[Target], abstract_params: Any) -> int:
  """The largest K of the targets' Hessians [K, K]: the calibration tokens GPTQ needs at least."""
  flat: dict[tuple, Any] = traverse_util.flatten_dict(abstract_params)
  return max((math.prod(flat[t.kernel].shape[t.lead:t.lead + t.in_rank]) for t in tgts
              if not t.table), default=0)


def hessians(mcfg: ModelConfig, params: Any, batches: Iterable[dict], exclude: str,
             mesh: Mesh, rules: Rules, vocab: bool = False
             ) -> tuple[dict[str, np.ndarray], int]:
  """({probe path (`Target.probe`): H [*lead, K, K] float64, sum over tokens / tokens seen},
  tokens seen) from the calibration
  batches, the model sharded over `mesh` by the rules as in training (the probes replicated). A
  batch with a row of padding only (the documents ran out) is left out."""
  model_def = make_model_def(mcfg, modify=lambda m: quant.attach_probes(m, exclude, vocab))
  shardings = traverse_util.flatten_dict(
      tree_shardings(model_def.logical_axes, model_def.abstract_params, mesh, rules))
  flat_abstract: dict[tuple, Any] = traverse_util.flatten_dict(model_def.abstract_params)
  probe_keys = [k for k in flat_abstract if str(k[-1]).endswith("hessian_probe")]
  base = {k: jax.device_put(v, shardings[k])
          for k, v in traverse_util.flatten_dict(params).items()}
  zeros = [jax.device_put(np.zeros(flat_abstract[k].shape, np.float32), shardings[k])
           for k in probe_keys]

  @jax.jit
  def step(base, probes, tokens, positions, segments):
    def total(pr):
      tree = traverse_util.unflatten_dict({**base, **dict(zip(probe_keys, pr))})
      with use_rules(mesh, rules):
        return jnp.sum(model_def.apply(tree, tokens, positions, segments))
    return jax.grad(total)(probes)

  sums = [np.zeros(flat_abstract[k].shape, np.float64) for k in probe_keys]
  seen = 0
  for batch in batches:
    if not batch["inputs_segmentation"].any(axis=1).all():
      continue
    rows = batch["inputs"].shape
    sharding = batch_sharding(mesh, rules, *rows)
    grads = step(base, zeros, *(jax.device_put(batch[k], sharding) for k in
                                ("inputs", "inputs_position", "inputs_segmentation")))
    for s, g in zip(sums, grads):
      s += np.asarray(jax.device_get(g), np.float64)
    seen += int((batch["inputs_segmentation"] > 0).sum())
  names = ["/".join(map(str, k)) for k in probe_keys]
  return {n: s / max(seen, 1) for n, s in zip(names, sums)}, seen


@dataclass
class LayerReport:
  name: str
  index: int              # the flat lead index (stacked repeats, experts); 0 unstacked
  error: float            # ||XW - XŴ||^2 / ||XW||^2 (calibration tokens), or weight error
  rtn_error: float | None  # RTN's, for comparison (GPTQ with a Hessian)
  unseen: bool = False     # an expert no calibration token reached (RTN, weight error)
  where: str = ""          # name[lead indices], as logged


def quantize_params(params: Any, tgts: list[Target], method: str, bits: int, group_size: int,
                    *, act_order: bool = True, damp: float = 0.01, block_size: int = 128,
                    hess: dict[str, np.ndarray] | None = None,
                    progress: bool = True
                    ) -> tuple[dict, list[LayerReport]]:
  """(the parameter tree with each target's kernel as integer levels + `kernel_scale`, a report
  per quantized matrix). int4 levels are packed (layers/int_levels.py: pack_int4); a vocabulary
  table is int8 levels [V, D] + scales [V] (`quantize_table`)."""
  flat: dict[tuple, Any] = dict(traverse_util.flatten_dict(params))   # (the leaves: arrays)
  reports = []
  # the bar only on a terminal: piped, its redraws would interleave with the per-matrix lines,
  # which then are the progress (one line per matrix)
  bar = tqdm(total=sum(math.prod(np.shape(flat[t.kernel])[:t.lead]) for t in tgts),
             desc=f"{method} int{bits}", unit="matrix",
             disable=not progress or not sys.stderr.isatty())
  for t in tgts:
    w = np.asarray(flat[t.kernel])
    if t.table:
      flat[t.kernel], flat[t.scale], err = quantize_table(w)
      reports.append(LayerReport(t.name, 0, err, None, where=t.name))
      bar.write(f"  {t.name}: relative weight error {err:.3e} (int8 table, a scale per row)")
      bar.update(1)
      continue
    lead, ins, outs = w.shape[:t.lead], w.shape[t.lead:t.lead + t.in_rank], \
        w.shape[t.lead + t.in_rank:]
    k, n, m = math.prod(ins), math.prod(outs), math.prod(lead)
    w3 = np.asarray(w.reshape(m, k, n), np.float32)
    h3 = None if hess is None else np.asarray(hess[t.probe].reshape(m, k, k), np.float32)
    # an expert no calibration token reached (a zero Hessian): RTN, its weight error
    seen: np.ndarray = np.ones(m, bool) if h3 is None else np.any(h3.reshape(m, -1), axis=1)
    with_gptq = method == "gptq" and h3 is not None
    c = _batch(m, k, n)
    qs, ss = [], []
    for j in range(0, m, c):
      q, sc, errors = _quantize_matrices(
          w3[j:j + c], None if h3 is None else h3[j:j + c], seen[j:j + c], damp, bits=bits,
          group_size=group_size, with_gptq=with_gptq, act_order=act_order,
          block_size=block_size)
      qs.append(np.asarray(q))
      ss.append(np.asarray(sc))
      for i, (err, rtn_err) in enumerate(np.asarray(errors).tolist(), start=j):
        where = f"{t.name}[{','.join(map(str, np.unravel_index(i, lead))) if lead else i}]"
        if not seen[i]:
          bar.write(f"  {where}: no calibration token reached this expert: RTN")
        rtn_cmp = rtn_err if with_gptq and seen[i] else None
        reports.append(LayerReport(t.name, i, err, rtn_cmp, not seen[i], where))
        what = "output" if h3 is not None and seen[i] else "weight"
        bar.write(f"  {where}: relative {what} error {err:.3e}" +
                  (f" (rtn {rtn_cmp:.3e})" if rtn_cmp is not None else ""))
        bar.update(1)
    q = np.concatenate(qs).reshape(w.shape)
    sc = np.concatenate(ss)
    flat[t.kernel] = int_levels.pack_int4(q, q.ndim - 1) if bits == 4 else q.astype(np.int8)
    flat[t.scale] = sc.reshape(*lead, sc.shape[1], *outs).astype(np.float32)
  bar.close()
  return traverse_util.unflatten_dict(flat), reports


def quantize_table(w_VD: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
  """(int8 levels [V, D], float32 scales [V], relative weight error) of a vocabulary table: RTN of
  the head's matrix w^T [D, V] with one group (`gptq.rtn`), in pieces of at most BATCH_BYTES of
  float32 rows (each row on its own: pieces change nothing)."""
  v, d = w_VD.shape
  step = max(1, min(v, BATCH_BYTES // (4 * d)))
  q, s = np.empty((v, d), np.int8), np.empty((v,), np.float32)
  err = norm = 0.0
  for start in range(0, v, step):
    part = np.asarray(w_VD[start:start + step], np.float32)
    q_DV, s_1V = gptq.rtn(jnp.asarray(part.T), 8, 0)
    q[start:start + step], s[start:start + step] = np.asarray(q_DV).T, np.asarray(s_1V)[0]
    deq = q[start:start + step].astype(np.float32) * s[start:start + step, None]
    err += float(np.sum((part - deq).astype(np.float64) ** 2))
    norm += float(np.sum(part.astype(np.float64) ** 2))
  return q, s, err / max(norm, 1e-30)


# the most bytes of float32 weights and Hessians quantized in one program (a batch of a stack's
# matrices: the experts of a layer, the layers of a scanned stack)
BATCH_BYTES = 1 << 28


def _batch(m: int, k: int, n: int) -> int:
  """How many of a stack's `m` matrices [K, N] (each with its Hessian [K, K]) one program
  quantizes: the largest divisor of m within BATCH_BYTES (one program shape per stack)."""
  fits = max(1, BATCH_BYTES // (4 * k * (n + k)))
  return max(d for d in range(1, m + 1) if m % d == 0 and d <= fits)


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "with_gptq", "act_order",
                                             "block_size"))
def _quantize_matrices(w_XKN: jax.Array, h_XKK: jax.Array | None, seen_X: jax.Array,
                       damp: float, *, bits: int, group_size: int, with_gptq: bool,
                       act_order: bool, block_size: int
                       ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(q_XKN, scale_XGN, [X, 2]: each matrix's error and RTN's) of X matrices at once, by RTN or
  (`with_gptq`) GPTQ; a matrix not `seen` (a zero Hessian) by RTN, with its weight error. One
  compiled program per stack shape and method, not one per matrix and operation."""
  def one(w, h, seen):
    q, s = gptq.rtn(w, bits, group_size)
    wq = gptq.dequantize(q, s)
    rtn_err = _error(w, wq, None) if h is None else \
        jnp.where(seen, _error(w, wq, h), _error(w, wq, None))
    err = rtn_err
    if with_gptq:
      gq, gs = gptq.gptq(w, h, bits=bits, group_size=group_size, act_order=act_order, damp=damp,
                         block_size=block_size)
      q, s = jnp.where(seen, gq, q), jnp.where(seen, gs, s)
      err = jnp.where(seen, _error(w, gptq.dequantize(gq, gs), h), rtn_err)
    return q, s, jnp.stack([err, rtn_err])
  return jax.vmap(one)(w_XKN, h_XKK, seen_X)


def _error(w: jax.Array, wq: jax.Array, h: jax.Array | None) -> jax.Array:
  """The relative output error (||XW - XŴ||^2 / ||XW||^2) with a Hessian, else the weight error."""
  if h is None:
    return jnp.sum((w - wq) ** 2) / jnp.maximum(jnp.sum(w ** 2), 1e-30)
  return gptq.layer_error(w, wq, h) / jnp.maximum(gptq.layer_error(w, 0 * w, h), 1e-30)


def dequantized(params: Any, tgts: list[Target], bits: int, dtype) -> dict:
  """The float parameters of an integer-weight tree (each kernel = levels x scale, in `dtype`;
  the scales dropped): what the integer model computes, as a plain model."""
  flat: dict[tuple, Any] = dict(traverse_util.flatten_dict(params))   # (the leaves: arrays)
  for t in tgts:
    q = np.asarray(flat[t.kernel])
    if t.table:
      s = np.asarray(flat.pop(t.scale), np.float32)
      flat[t.kernel] = (q.astype(np.float32) * s[:, None]).astype(dtype)
      continue
    if bits == 4:
      q = int_levels.unpack_int4(q, q.ndim - 1)
    s = np.asarray(flat.pop(t.scale), np.float32)
    lead = q.shape[:t.lead]
    k = math.prod(q.shape[t.lead:t.lead + t.in_rank])
    q3 = q.reshape(math.prod(lead), k, -1).astype(np.float32)
    s3 = s.reshape(math.prod(lead), s.shape[t.lead], -1)
    g = s3.shape[1]
    w = (q3.reshape(q3.shape[0], g, k // g, -1) * s3[:, :, None, :]).reshape(q.shape)
    flat[t.kernel] = w.astype(dtype)
  return traverse_util.unflatten_dict(flat)
