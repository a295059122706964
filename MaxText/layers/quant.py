"""Quantized projections, set on any model's `linear.DenseGeneral` modules by module path (as LoRA
is, layers/lora.py) — generic code, no family or parameter named.

Which projections: those `lora.default_target` takes (a named axis on each side, none "vocab":
the attention, Gated DeltaNet and MLP projections of the decoder layers; not the embedding, the LM
head, a router or a gate to one value), minus those whose module path ("/" joined, e.g.
"decoder/runs/0/0/mlp/up") the regex `exclude` searches. Also the routed experts of MoE layers
(layers/moe.py: `RoutedExperts`, stacked wi [*lead, E, D, 2F] and wo [*lead, E, F, D] multiplied
by `jax.lax.ragged_dot`), unless `exclude` searches their module path (".../experts"): each
expert's wi and wo are quantized as the projections are (per expert, per output column, scales
over the contraction axis), through the experts' own `quant` object (`moe.FloatExperts`' two
methods: the operands handed to the grouped matmul, and the grouped matmul) — see "routed experts"
below.

Three roles, each a static, hashable `quant` object on the projection that computes its matmul:
  * `Qat` — quantized training through qwix: the rules are qwix `QtRule`s (`qat_rules`: the
    exceptions first with no qtype, then the quantized rule for everything else, matched on the
    module path with `re.fullmatch` as qwix's providers do); the matmul is qwix's
    `dot_general_qt` (a quantized forward — int8 / fp8 weights and per-token activations, int4
    weights only — and a straight-through backward on the original operands). With LoRA the
    frozen base is the quantized operand and the adapters stay in full precision (QLoRA).
  * `IntWeights` — a post-training-quantized checkpoint (MaxText.quantize): `kernel` holds the
    integer levels (int8, or int4 packed two per uint8 along the kernel's last axis, so every other
    dimension — the ones model code may read — keeps its size) and
    `kernel_scale` [*lead, G, *out] the per-group scales (G groups of consecutive rows of the
    flattened input); the matmul is qwix's `dot_general` on a `qwix.QArray` of them.
  * `HessianProbe` — calibration: the projection's forward is unchanged, and the gradient of the
    zero parameter `hessian_probe` [*lead, K, K] is X^T X over the tokens it saw (K: the flattened
    input), so one backward pass gives every layer's GPTQ Hessian, scanned layers included.

qwix's rules, qtypes, QAT and PTQ arithmetic are used as they are; its `quantize_model`
interception is not: it finds a weight by identity with a module attribute, but a projection here
reshapes and casts its kernel before a plain 2-D matmul, and the pattern stack calls its layers
through `nnx.merge` inside `jax.lax.scan` (as for LoRA, layers/lora.py). So the module-path match
happens once, when the model is built, and the projection calls qwix's op itself.
A QAT-trained checkpoint holds float weights: decoding it runs in float (`quantization` is not an
architecture key); `python -m MaxText.quantize` turns it into integer weights.
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from flax import nnx
from qwix._src.core import dot_general_qt

from MaxText.layers.linear import DenseGeneral, matmul
from MaxText.layers import lora
from MaxText.layers.moe import FloatExperts, RoutedExperts

DIMS = (((1,), (0,)), ((), ()))   # x_MK @ w_KN
# quantization key → (weight qtype, activation qtype); int4 quantizes the weights only
QAT_TYPES = {"int8": (jnp.int8, jnp.int8), "fp8": (jnp.float8_e4m3fn, jnp.float8_e4m3fn),
             "int4": (jnp.int4, None)}
WEIGHT_BITS = (0, 4, 8)


def targets(model: nnx.Module, exclude: str) -> list[tuple[str, DenseGeneral]]:
  """[(module path, projection)] quantized: LoRA's default projections minus `exclude`'s matches."""
  regex = re.compile(exclude) if exclude else None
  return [(name, node) for name, node in lora.targets(model, "")
          if not (regex and regex.search(name))]


def _split_kernel(dense: DenseGeneral) -> tuple[tuple, tuple, tuple, tuple]:
  """(shape, logical axes, lead shape, in shape) of a projection's kernel [*lead, *in, *out]."""
  kernel = dense.kernel
  shape, axes = kernel.get_value().shape, tuple(kernel.get_metadata()["logical_axes"])
  lead = len(shape) - dense.in_rank - dense.out_rank
  return shape, axes, shape[:lead], shape[lead:lead + dense.in_rank]


# ---- quantized training (qwix) -------------------------------------------------------------------
def qat_rules(mode: str, exclude: str) -> list[qwix.QtRule]:
  """The qwix rules of `quantization=mode`: the exceptions (full precision), then the rest."""
  weight, act = QAT_TYPES[mode]
  rules = [qwix.QtRule(module_path=f".*(?:{exclude}).*")] if exclude else []
  return rules + [qwix.QtRule(module_path=".*", weight_qtype=weight, act_qtype=act)]


def rule_for(rules: list[qwix.QtRule], path: str) -> qwix.QtRule | None:
  """The first rule whose module_path matches `path` (qwix's order of precedence)."""
  return next((r for r in rules if re.fullmatch(r.module_path, path)), None)


@dataclass(frozen=True)
class Qat:
  rule: qwix.QtRule

  def __call__(self, dense: DenseGeneral, x_MK: jax.Array, out_dtype) -> jax.Array:
    r = self.rule
    config = dot_general_qt.DotGeneralQtConfig(
        lhs_qtype=r.act_qtype, rhs_qtype=r.weight_qtype, tile_size=r.tile_size,
        lhs_calibration_method=r.act_calibration_method or "absmax",
        rhs_calibration_method=r.weight_calibration_method,
        use_original_residuals=True)   # forward quantized only: straight-through backward
    w_KN = dense.kernel[...].reshape(x_MK.shape[1], -1).astype(x_MK.dtype)
    y = dot_general_qt.dot_general_qt(x_MK, w_KN, DIMS, config)
    return y.astype(out_dtype or x_MK.dtype)


def attach_qat(model: nnx.Module, mode: str, exclude: str) -> list[str]:
  """Sets `Qat` on the projections the rules quantize; their paths."""
  rules = qat_rules(mode, exclude)
  done = []
  for name, dense in targets(model, ""):
    rule = rule_for(rules, name)
    if rule is not None and rule.weight_qtype is not None:
      dense.quant = Qat(rule)
      done.append(name)
  for name, experts in expert_targets(model, ""):
    rule = rule_for(rules, name)
    if rule is not None and rule.weight_qtype is not None:
      experts.quant = ExpertQat(rule)
      done.append(name)
  return done


# ---- integer weights (post-training quantization) ------------------------------------------------
def pack_int4(q: np.ndarray, axis: int) -> np.ndarray:
  """Two int4 levels per uint8 along `axis` (even index: low nibble), halving that axis."""
  q = np.moveaxis(np.asarray(q, np.int8), axis, -1)
  if q.shape[-1] % 2:
    raise ValueError(f"int4 packing needs an even size along the packed axis, got {q.shape[-1]}")
  u = (q.astype(np.int16) & 0xF).astype(np.uint8)
  return np.moveaxis(u[..., 0::2] | (u[..., 1::2] << 4), -1, axis)


def unpack_int4(p: jax.Array, axis: int) -> jax.Array:
  """The int8 levels of `pack_int4` (doubling `axis`)."""
  p = jnp.moveaxis(p, axis, -1)
  both = jnp.stack([(p & 0xF), (p >> 4)], axis=-1).astype(jnp.int8)
  both = jnp.where(both >= 8, both - 16, both).astype(jnp.int8)
  return jnp.moveaxis(both.reshape(*p.shape[:-1], p.shape[-1] * 2), -1, axis)


def group_size_for(k: int, group_size: int) -> int:
  """Rows per group for an input of K (0 or >= K: one group); ValueError when it does not divide."""
  gs = k if group_size <= 0 or group_size >= k else group_size
  if k % gs:
    raise ValueError(f"group_size={group_size} does not divide the input size {k}")
  return gs


@dataclass(frozen=True)
class IntWeights:
  bits: int

  def __call__(self, dense: DenseGeneral, x_MK: jax.Array, out_dtype) -> jax.Array:
    q = dense.kernel[...]
    if self.bits == 4:
      q = unpack_int4(q, q.ndim - 1)
    q_KN = q.reshape(x_MK.shape[1], -1)
    scale_GN = dense.kernel_scale[...].reshape(-1, q_KN.shape[1])
    qtype = jnp.int4 if self.bits == 4 else jnp.int8
    w = qwix.QArray(qvalue=q_KN.astype(qtype), scale=scale_GN.astype(x_MK.dtype), qtype=qtype)
    y = qwix.dot_general(x_MK, w, DIMS, preferred_element_type=jnp.float32)
    return y.astype(out_dtype or x_MK.dtype)


def int_weight_layout(dense: DenseGeneral, bits: int, group_size: int
                      ) -> tuple[tuple, Any, tuple, tuple]:
  """(kernel shape, its dtype, scale shape, scale logical axes) of a projection's integer form."""
  shape, axes, lead, _ = _split_kernel(dense)
  return int_layout(shape, axes, len(lead), dense.in_rank, bits, group_size)


def int_layout(shape: tuple, axes: tuple, lead: int, in_rank: int, bits: int, group_size: int
               ) -> tuple[tuple, Any, tuple, tuple]:
  """(levels' shape, their dtype, scale shape, scale logical axes) of a weight [*lead, *in, *out]
  (lead: stacked axes, e.g. the scan's layers and the experts) quantized as the matrices
  [prod(in), prod(out)]."""
  k = math.prod(shape[lead:lead + in_rank])
  gs = group_size_for(k, group_size)
  out = shape[lead + in_rank:]
  if bits == 4:
    if shape[-1] % 2:
      raise ValueError(f"bits=4 packs two levels per byte along the kernel's last axis, which "
                       f"needs an even size; it is {shape[-1]}")
    shape = (*shape[:-1], shape[-1] // 2)
  return (shape, jnp.uint8 if bits == 4 else jnp.int8, (*shape[:lead], k // gs, *out),
          (*axes[:lead], None, *axes[lead + in_rank:]))


def attach_int_weights(model: nnx.Module, bits: int, group_size: int, exclude: str) -> list[str]:
  """Turns the targets' kernels into integer levels + `kernel_scale` (zeros until loaded)."""
  done = []
  for name, dense in targets(model, exclude):
    try:
      kshape, kdtype, sshape, saxes = int_weight_layout(dense, bits, group_size)
    except ValueError as e:
      raise ValueError(f"{name}: {e}") from None
    axes = tuple(dense.kernel.get_metadata()["logical_axes"])
    dense.kernel = nnx.Param(jnp.zeros(kshape, kdtype), logical_axes=axes)
    dense.kernel_scale = nnx.Param(jnp.zeros(sshape, jnp.float32), logical_axes=saxes)
    dense.quant = IntWeights(bits)
    done.append(name)
  for name, experts in expert_targets(model, exclude):
    for w in EXPERT_WEIGHTS:
      shape, axes = _expert_weight(experts, w)
      try:
        kshape, kdtype, sshape, saxes = int_layout(shape, axes, len(shape) - 2, 1, bits, group_size)
      except ValueError as e:
        raise ValueError(f"{name}/{w}: {e}") from None
      setattr(experts, w, nnx.Param(jnp.zeros(kshape, kdtype), logical_axes=axes))
      setattr(experts, f"{w}_scale", nnx.Param(jnp.zeros(sshape, jnp.float32), logical_axes=saxes))
    experts.quant = ExpertIntWeights(bits)
    done.append(name)
  return done


# ---- calibration -----------------------------------------------------------------------------------
@jax.custom_vjp
def _probe(x_MK: jax.Array, probe_KK: jax.Array) -> jax.Array:
  del probe_KK
  return x_MK


def _probe_fwd(x_MK, probe_KK):
  del probe_KK
  return x_MK, x_MK


def _probe_bwd(x_MK, g_MK):
  x = x_MK.astype(jnp.float32)
  return g_MK, x.T @ x


_probe.defvjp(_probe_fwd, _probe_bwd)


@dataclass(frozen=True)
class HessianProbe:
  def __call__(self, dense: DenseGeneral, x_MK: jax.Array, out_dtype) -> jax.Array:
    x_MK = _probe(x_MK, dense.hessian_probe[...])
    return matmul(x_MK, dense.kernel[...].reshape(x_MK.shape[1], -1), out_dtype=out_dtype)


def attach_probes(model: nnx.Module, exclude: str) -> list[str]:
  """Adds a zero `hessian_probe` [*lead, K, K] (fp32, replicated) to each target."""
  done = []
  for name, dense in targets(model, exclude):
    _, axes, lead, ins = _split_kernel(dense)
    k = math.prod(ins)
    dense.hessian_probe = nnx.Param(jnp.zeros((*lead, k, k), jnp.float32),
                                    logical_axes=(*axes[:len(lead)], None, None))
    dense.quant = HessianProbe()
    done.append(name)
  for name, experts in expert_targets(model, exclude):
    for w in EXPERT_WEIGHTS:
      shape, axes = _expert_weight(experts, w)
      setattr(experts, f"{w}_hessian_probe",
              nnx.Param(jnp.zeros((*shape[:-2], shape[-2], shape[-2]), jnp.float32),
                        logical_axes=(*axes[:-2], None, None)))
    experts.quant = ExpertProbe()
    done.append(name)
  return done


# ---- routed experts ----------------------------------------------------------------------------
# The same three roles for `RoutedExperts` (layers/moe.py), whose `quant` object hands its grouped
# matmul the operands (every leaf with the expert axis first: they split over the `expert` mesh
# axis inside the shard_map of expert parallelism) and is that grouped matmul (rows_MK sorted by
# expert, sizes_X rows per local expert, w [X, K, N] per expert). The lead axes of a stored weight
# [*lead, E, K, N] (the scan's layers) are gone by the time the matmul runs.
#
# QAT: qwix 0.1.8 intercepts `jax.lax.ragged_dot` (its `QtProvider.ragged_dot`), but only through
# `quantize_model` (not usable here, module docstring), and its `ragged_dot_qt` scales the weights
# per output column shared by all experts, cannot leave activations unquantized (int4) and
# differentiates the quantized operands; so the experts' matmul fake-quantizes with qwix's own
# `quantize` / `dequantize` (per expert and output column, per-token activations) and
# differentiates straight through to the original operands, as `Qat` does.
EXPERT_WEIGHTS = ("wi", "wo")
# X^T X per group of rows: contract the rows of x with themselves, one result per group
_GROUP_GRAM = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[])


def expert_targets(model: nnx.Module, exclude: str) -> list[tuple[str, RoutedExperts]]:
  """[(module path, routed experts)] quantized: every `RoutedExperts` whose path `exclude` does
  not search."""
  regex = re.compile(exclude) if exclude else None
  out = []
  for path, node in nnx.iter_graph(model):
    name = "/".join(map(str, path))
    if isinstance(node, RoutedExperts) and not (regex and regex.search(name)):
      out.append((name, node))
  return out


def _expert_weight(experts: RoutedExperts, w: str) -> tuple[tuple, tuple]:
  var = getattr(experts, w)
  return var.get_value().shape, tuple(var.get_metadata()["logical_axes"])


def _fake_quant(a: jax.Array, qtype, channels: tuple, tile_size, method: str) -> jax.Array:
  """qwix's quantize then dequantize: one scale per index of `channels` (and per tile of
  `tile_size` along axis 1, the contraction axis of both [M, K] rows and [X, K, N] weights)."""
  q = qwix.quantize(a, qtype, channelwise_axes=channels,
                    tiled_axes={1: tile_size} if tile_size else None, calibration_method=method)
  return qwix.dequantize(q)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _ragged_dot_qt(rows_MK, w_XKN, sizes_X, rule: qwix.QtRule) -> jax.Array:
  x = rows_MK if rule.act_qtype is None else _fake_quant(
      rows_MK, rule.act_qtype, (0,), rule.tile_size, rule.act_calibration_method or "absmax")
  w = _fake_quant(w_XKN, rule.weight_qtype, (0, 2), rule.tile_size,
                  rule.weight_calibration_method)
  return jax.lax.ragged_dot(x, w, sizes_X)


def _ragged_dot_qt_fwd(rows_MK, w_XKN, sizes_X, rule):
  return _ragged_dot_qt(rows_MK, w_XKN, sizes_X, rule), (rows_MK, w_XKN, sizes_X)


def _ragged_dot_qt_bwd(rule, res, g_MN):
  del rule
  rows_MK, w_XKN, sizes_X = res
  _, vjp = jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, sizes_X), rows_MK, w_XKN)
  return (*vjp(g_MN), None)   # straight through: the float matmul's gradient, original operands


_ragged_dot_qt.defvjp(_ragged_dot_qt_fwd, _ragged_dot_qt_bwd)


@dataclass(frozen=True)
class ExpertQat(FloatExperts):
  """Quantized training of the experts: fake-quantized forward, straight-through backward."""
  rule: qwix.QtRule

  def ragged_dot(self, rows_MK, w, sizes_X):
    return _ragged_dot_qt(rows_MK, w, sizes_X, self.rule)


@dataclass(frozen=True)
class ExpertIntWeights(FloatExperts):
  """A post-training-quantized checkpoint's experts: `wi` / `wo` hold the integer levels (int4:
  packed along the last axis, as `IntWeights`), `wi_scale` / `wo_scale` [*lead, E, G, N] the
  scales; the matmul is qwix's `ragged_dot` on a `QArray` of the local experts' levels."""
  bits: int

  def operands(self, experts, dtype):
    return tuple((getattr(experts, w)[...], getattr(experts, f"{w}_scale")[...])
                 for w in EXPERT_WEIGHTS)

  def ragged_dot(self, rows_MK, w, sizes_X):
    q_XKN, scale_XGN = w
    if self.bits == 4:
      q_XKN = unpack_int4(q_XKN, q_XKN.ndim - 1)
    qtype = jnp.int4 if self.bits == 4 else jnp.int8
    qw = qwix.QArray(qvalue=q_XKN.astype(qtype), scale=scale_XGN.astype(rows_MK.dtype),
                     qtype=qtype)
    y = qwix.ragged_dot(rows_MK, qw, sizes_X, preferred_element_type=jnp.float32)
    return y.astype(rows_MK.dtype)


@jax.custom_vjp
def _group_probe(rows_MK, sizes_X, probe_XKK):
  del sizes_X, probe_XKK
  return rows_MK


def _group_probe_fwd(rows_MK, sizes_X, probe_XKK):
  del probe_XKK
  return rows_MK, (rows_MK, sizes_X)


def _group_probe_bwd(res, g_MK):
  rows_MK, sizes_X = res
  x = rows_MK.astype(jnp.float32)
  return g_MK, None, jax.lax.ragged_dot_general(x, x, sizes_X, _GROUP_GRAM)


_group_probe.defvjp(_group_probe_fwd, _group_probe_bwd)


@dataclass(frozen=True)
class ExpertProbe(FloatExperts):
  """Calibration: the gradient of each zero `wi_hessian_probe` / `wo_hessian_probe`
  [*lead, E, K, K] is, per expert, X^T X over the token copies routed to it (an expert no token
  reached: zeros)."""

  def operands(self, experts, dtype):
    return tuple((w, getattr(experts, f"{name}_hessian_probe")[...])
                 for w, name in zip(super().operands(experts, dtype), EXPERT_WEIGHTS))

  def ragged_dot(self, rows_MK, w, sizes_X):
    w_XKN, probe_XKK = w
    return jax.lax.ragged_dot(_group_probe(rows_MK, sizes_X, probe_XKK), w_XKN, sizes_X)


# ---- the model's keys ------------------------------------------------------------------------------
def apply(model: nnx.Module, mcfg: Any) -> None:
  """What the model config asks: QAT (`quantization`) or integer weights (`weight_bits`)."""
  if mcfg.weight_bits:
    attach_int_weights(model, mcfg.weight_bits, mcfg.weight_group_size, mcfg.weight_quant_exclude)
  elif mcfg.quantization:
    attach_qat(model, mcfg.quantization, mcfg.quantization_exclude)


def problems(mcfg: Any) -> list[tuple[str, str]]:
  """Combinations refused before anything is built (key, why)."""
  out = []
  if mcfg.weight_bits not in WEIGHT_BITS:
    out.append(("weight_bits", f"weight_bits={mcfg.weight_bits}: 8, 4 or 0 (float weights)"))
  for key in ("quantization_exclude", "weight_quant_exclude"):
    try:
      re.compile(getattr(mcfg, key))
    except re.error as e:
      out.append((key, f"{key}={getattr(mcfg, key)!r} is not a regex: {e}"))
  if mcfg.weight_bits and mcfg.quantization:
    out.append(("quantization", f"quantization={mcfg.quantization} (quantized training) on a "
                f"checkpoint with integer weights (weight_bits={mcfg.weight_bits}): train from "
                "the full-precision checkpoint instead"))
  if mcfg.weight_bits and mcfg.lora_rank:
    out.append(("lora_rank", f"lora_rank={mcfg.lora_rank} on integer weights (weight_bits="
                f"{mcfg.weight_bits}) is not supported; for QLoRA train with quantization=int8 "
                "(or int4) on the full-precision checkpoint"))
  return out
