"""Quantized projections, set on any model's `linear.DenseGeneral` modules by module path (as LoRA
is, layers/lora.py) — generic code, no family or parameter named.

Which projections: those `lora.default_target` takes (a named axis on each side, none "vocab":
the attention, Gated DeltaNet and MLP projections of the decoder layers; not the embedding, the LM
head, a router or a gate to one value) — with `vocab` (`weight_quant_vocab`) also an untied LM head
(a kernel with a "vocab" axis; the model's own vocabulary tables, a tied head's included, are
layers/quant_vocab.py's) — minus those whose module path ("/" joined, e.g.
"decoder/runs/0/0/mlp/up") the regex `exclude` searches. Also the routed experts of MoE layers
(layers/moe.py: `RoutedExperts`), unless `exclude` searches their module path (".../experts"):
their forms are in layers/quant_experts.py; the functions here attach both.

Three roles, each a static, hashable `quant` object on the projection that computes its matmul:
  * `Qat` — quantized training through qwix: the rules are qwix `QtRule`s (`qat_rules`: the
    exceptions first with no qtype, then the quantized rule for everything else, matched on the
    module path with `re.fullmatch` as qwix's providers do); the matmul is qwix's
    `dot_general_qt` (a quantized forward — int8 / fp8 weights and per-token activations, int4
    weights only — and a straight-through backward on the original operands). With LoRA the
    frozen base is the quantized operand and the adapters stay in full precision (QLoRA).
  * `IntWeights` — a post-training-quantized checkpoint (MaxText.quantize): `kernel` holds the
    integer levels (int8, or int4 packed two per uint8 along the kernel's last axis, so every other
    dimension — the ones model code may read — keeps its size: layers/int_levels.py) and
    `kernel_scale` [*lead, G, *out] the per-group scales (G groups of consecutive rows of the
    flattened input); the matmul is qwix's `dot_general` on a `qwix.QArray` of them (dequantise,
    then a float matmul), except on the plain hot path (GPU / TPU) for inputs of up to
    GROUPED_MAX_ROWS rows (decoding): `grouped_int_matmul`, the levels converted inside the dot and
    the group scales on its output.
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

import math
import re
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import qwix
from flax import nnx, traverse_util

from MaxText.backend import compat, hot_path
from MaxText.layers import lora, quant_experts, quant_vocab
from MaxText.layers.int_levels import MIN_ROWS, int_layout, unpack_int4
from MaxText.layers.linear import DenseGeneral, matmul

DIMS = (((1,), (0,)), ((), ()))   # x_MK @ w_KN
# quantization key → (weight qtype, activation qtype); int4 quantizes the weights only
QAT_TYPES = {"int8": (jnp.int8, jnp.int8), "fp8": (jnp.float8_e4m3fn, jnp.float8_e4m3fn),
             "int4": (jnp.int4, None)}
WEIGHT_BITS = (0, 4, 8)
# integer weights on the plain hot path (GPU / TPU): matmuls of up to GROUPED_MAX_ROWS rows (the
# decoding steps) run `grouped_int_matmul`, its rows padded to at least MIN_ROWS; longer inputs
# (prefill, evaluation: compute-bound) dequantise first (qwix), where the [G, rows, N] fp32 partial
# products would otherwise be as large as the activations times the groups
GROUPED_MAX_ROWS = 256


def targets(model: nnx.Module, exclude: str, vocab: bool = False
            ) -> list[tuple[str, DenseGeneral]]:
  """[(module path, projection)] quantized: LoRA's default projections (with `vocab` also the
  projections onto the vocabulary: an untied LM head) minus `exclude`'s matches."""
  regex = re.compile(exclude) if exclude else None
  chosen = lora.targets(model, "")
  if vocab:
    chosen += [(name, node) for name, node in _vocab_projections(model)]
  return [(name, node) for name, node in chosen if not (regex and regex.search(name))]


def _vocab_projections(model: nnx.Module) -> list[tuple[str, DenseGeneral]]:
  """[(module path, projection)] whose kernel has a "vocab" axis (an untied LM head)."""
  out = []
  for path, node in nnx.iter_graph(model):
    if isinstance(node, DenseGeneral):
      axes = tuple(node.kernel.get_metadata().get("logical_axes") or ())
      if "vocab" in axes:
        out.append(("/".join(map(str, path)), node))
  return out


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
    w_KN = dense.kernel[...].reshape(x_MK.shape[1], -1).astype(x_MK.dtype)
    y = compat.dot_general_qt(
        x_MK, w_KN, DIMS, lhs_qtype=r.act_qtype, rhs_qtype=r.weight_qtype, tile_size=r.tile_size,
        lhs_calibration_method=r.act_calibration_method or "absmax",
        rhs_calibration_method=r.weight_calibration_method,
        use_original_residuals=True)   # forward quantized only: straight-through backward
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
  for name, experts in quant_experts.targets(model, ""):
    rule = rule_for(rules, name)
    if rule is not None and rule.weight_qtype is not None:
      experts.quant = quant_experts.ExpertQat(rule)
      done.append(name)
  return done


# ---- integer weights (post-training quantization) ------------------------------------------------
@dataclass(frozen=True)
class IntWeights:
  bits: int

  def __call__(self, dense: DenseGeneral, x_MK: jax.Array, out_dtype) -> jax.Array:
    q = dense.kernel[...]
    if self.bits == 4:
      q = unpack_int4(q, q.ndim - 1)
    q_KN = q.reshape(x_MK.shape[1], -1)
    scale_GN = dense.kernel_scale[...].reshape(-1, q_KN.shape[1])
    if not hot_path.tuned() and x_MK.shape[0] <= GROUPED_MAX_ROWS:
      return grouped_int_matmul(x_MK, q_KN, scale_GN, out_dtype or x_MK.dtype)
    qtype = jnp.int4 if self.bits == 4 else jnp.int8
    w = qwix.QArray(qvalue=q_KN.astype(qtype), scale=scale_GN.astype(x_MK.dtype), qtype=qtype)
    y = qwix.dot_general(x_MK, w, DIMS, preferred_element_type=jnp.float32)
    return y.astype(out_dtype or x_MK.dtype)


def grouped_int_matmul(x_MK: jax.Array, q_KN: jax.Array, scale_GN: jax.Array, out_dtype
                       ) -> jax.Array:
  """x @ w for w = the levels q [K, N] times their scale per group of K // G consecutive rows,
  without w: each group's product x[:, group] @ q[group] (levels converted to x's dtype — exact —
  accumulated in fp32) times the group's scales in fp32, summed over the groups. XLA on TPU fuses
  the levels' convert into the matmul and the scaling and the sum over the groups into its output:
  the int8 levels are read once, where dequantising first (qwix's `dot_general` with a bf16 input)
  writes and reads w in bf16 every call. Fewer than MIN_ROWS rows are padded to MIN_ROWS with
  zeros: XLA runs a one-row product as a matrix-vector loop that converts the levels apart."""
  m, k = x_MK.shape
  g, n = scale_GN.shape
  rows = max(m, MIN_ROWS)
  x = jnp.pad(x_MK, ((0, rows - m), (0, 0))) if rows > m else x_MK
  w_GgN = q_KN.reshape(g, k // g, n).astype(x.dtype)
  y_GMN = jax.lax.dot_general(x.reshape(rows, g, k // g), w_GgN, (((2,), (1,)), ((1,), (0,))),
                              preferred_element_type=jnp.float32)
  y = (y_GMN * scale_GN.astype(jnp.float32)[:, None, :]).sum(0)
  return (y[:m] if rows > m else y).astype(out_dtype)


def float_kernel(dense: DenseGeneral) -> jax.Array:
  """A projection's kernel as floats: an integer one's levels x group scales (fp32)."""
  if not isinstance(dense.quant, IntWeights):
    return dense.kernel[...]
  q = dense.kernel[...]
  if dense.quant.bits == 4:
    q = unpack_int4(q, q.ndim - 1)
  n_lead = q.ndim - dense.in_rank - dense.out_rank
  lead, k = q.shape[:n_lead], math.prod(q.shape[n_lead:n_lead + dense.in_rank])
  scale = dense.kernel_scale[...].astype(jnp.float32)
  g = scale.shape[n_lead]
  w = q.astype(jnp.float32).reshape(*lead, g, k // g, -1) * scale.reshape(*lead, g, 1, -1)
  return w.reshape(q.shape)


def int_weight_layout(dense: DenseGeneral, bits: int, group_size: int
                      ) -> tuple[tuple, Any, tuple, tuple]:
  """(kernel shape, its dtype, scale shape, scale logical axes) of a projection's integer form."""
  shape, axes, lead, _ = _split_kernel(dense)
  return int_layout(shape, axes, len(lead), dense.in_rank, bits, group_size)


def attach_int_weights(model: nnx.Module, bits: int, group_size: int, exclude: str,
                       vocab: bool = False) -> list[str]:
  """Turns the targets' kernels into integer levels + `kernel_scale` (zeros until loaded); with
  `vocab` also the model's vocabulary tables (int8, layers/quant_vocab.py)."""
  done = []
  for name, dense in targets(model, exclude, vocab):
    try:
      kshape, kdtype, sshape, saxes = int_weight_layout(dense, bits, group_size)
    except ValueError as e:
      raise ValueError(f"{name}: {e}") from None
    axes = tuple(dense.kernel.get_metadata()["logical_axes"])
    dense.kernel = nnx.Param(jnp.zeros(kshape, kdtype), logical_axes=axes)
    dense.kernel_scale = nnx.Param(jnp.zeros(sshape, jnp.float32), logical_axes=saxes)
    dense.quant = IntWeights(bits)
    done.append(name)
  for name, experts in quant_experts.targets(model, exclude):
    quant_experts.attach_int_weights(name, experts, bits, group_size)
    done.append(name)
  if vocab:
    done += quant_vocab.attach(model, exclude)
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


def attach_probes(model: nnx.Module, exclude: str, vocab: bool = False) -> list[str]:
  """Adds a zero `hessian_probe` [*lead, K, K] (fp32, replicated) to each target."""
  done = []
  for name, dense in targets(model, exclude, vocab):
    _, axes, lead, ins = _split_kernel(dense)
    k = math.prod(ins)
    dense.hessian_probe = nnx.Param(jnp.zeros((*lead, k, k), jnp.float32),
                                    logical_axes=(*axes[:len(lead)], None, None))
    dense.quant = HessianProbe()
    done.append(name)
  for name, experts in quant_experts.targets(model, exclude):
    quant_experts.attach_probes(experts)
    done.append(name)
  return done


# ---- checkpoints quantized by an earlier version ----------------------------------------------------
SCALE = "_scale"   # the scales of an integer weight `w` are `w + SCALE` (kernel_scale, wi_scale, ...)


def kept_float(abstract_params: Any, stored: set[str]) -> list[str]:
  """The modules this integer model holds as levels + scales that a checkpoint (`stored`: its
  arrays' "/"-joined key paths) holds as the weight alone, without its scales — a checkpoint
  quantized by a version that kept them in float (e.g. routed experts before they were quantized).
  Their module paths, sorted."""
  names = {"/".join(map(str, k)) for k in traverse_util.flatten_dict(abstract_params)}
  return sorted({name.rsplit("/", 1)[0] for name in names
                 if name.endswith(SCALE) and name not in stored and name[:-len(SCALE)] in stored})


# ---- the model's keys ------------------------------------------------------------------------------
def apply(model: nnx.Module, mcfg: Any) -> None:
  """What the model config asks: QAT (`quantization`) or integer weights (`weight_bits`)."""
  if mcfg.weight_bits:
    attach_int_weights(model, mcfg.weight_bits, mcfg.weight_group_size, mcfg.weight_quant_exclude,
                       mcfg.weight_quant_vocab)
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
  if mcfg.weight_quant_vocab and mcfg.weight_bits != 8:
    out.append(("weight_quant_vocab", f"weight_quant_vocab=true stores the vocabulary tables in "
                f"int8: it needs weight_bits=8 (it is {mcfg.weight_bits})"))
  if mcfg.weight_bits and mcfg.quantization:
    out.append(("quantization", f"quantization={mcfg.quantization} (quantized training) on a "
                f"checkpoint with integer weights (weight_bits={mcfg.weight_bits}): train from "
                "the full-precision checkpoint instead"))
  if mcfg.weight_bits and mcfg.lora_rank:
    out.append(("lora_rank", f"lora_rank={mcfg.lora_rank} on integer weights (weight_bits="
                f"{mcfg.weight_bits}) is not supported; for QLoRA train with quantization=int8 "
                "(or int4) on the full-precision checkpoint"))
  return out
