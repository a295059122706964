"""The routed experts' quantized forms: the three roles of layers/quant.py (quantized training,
integer weights, calibration probes) for `moe.RoutedExperts` (stacked wi [*lead, E, D, 2F] and
wo [*lead, E, F, D] multiplied by `jax.lax.ragged_dot`), each expert's wi and wo quantized as a
projection is (per expert, per output column, scales over the contraction axis).

Each form is the experts' `quant` object (`moe.FloatExperts`' two methods): `operands` hands the
grouped matmul its weights (every leaf with the expert axis first: they split over the `expert`
mesh axis inside the shard_map of expert parallelism) and `ragged_dot` is that grouped matmul
(rows_MK sorted by expert, sizes_X rows per local expert, w [X, K, N] per expert). The lead axes
of a stored weight [*lead, E, K, N] (the scan's layers) are gone by the time the matmul runs.

QAT: qwix 0.1.8 intercepts `jax.lax.ragged_dot` (its `QtProvider.ragged_dot`), but only through
`quantize_model` (not usable here, layers/quant.py's docstring), and its `ragged_dot_qt` scales the
weights per output column shared by all experts, cannot leave activations unquantized (int4) and
differentiates the quantized operands; so the experts' matmul fake-quantizes with qwix's own
`quantize` / `dequantize` (per expert and output column, per-token activations) and
differentiates straight through to the original operands, as `quant.Qat` does.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import qwix
from flax import nnx

from MaxText.layers.int_levels import int_layout, unpack_int4
from MaxText.layers.moe import FloatExperts, RoutedExperts

WEIGHTS = ("wi", "wo")
# X^T X per group of rows: contract the rows of x with themselves, one result per group
_GROUP_GRAM = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[])


def targets(model: nnx.Module, exclude: str) -> list[tuple[str, RoutedExperts]]:
  """[(module path, routed experts)] quantized: every `RoutedExperts` whose path `exclude` does
  not search."""
  regex = re.compile(exclude) if exclude else None
  out = []
  for path, node in nnx.iter_graph(model):
    name = "/".join(map(str, path))
    if isinstance(node, RoutedExperts) and not (regex and regex.search(name)):
      out.append((name, node))
  return out


def _weight(experts: RoutedExperts, w: str) -> tuple[tuple, tuple]:
  var = getattr(experts, w)
  return var.get_value().shape, tuple(var.get_metadata()["logical_axes"])


# ---- quantized training --------------------------------------------------------------------------
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


# ---- integer weights (post-training quantization) ------------------------------------------------
@dataclass(frozen=True)
class ExpertIntWeights(FloatExperts):
  """A post-training-quantized checkpoint's experts: `wi` / `wo` hold the integer levels (int4:
  packed along the last axis, as `quant.IntWeights`), `wi_scale` / `wo_scale` [*lead, E, G, N]
  the scales; the matmul is qwix's `ragged_dot` on a `QArray` of the local experts' levels."""
  bits: int

  def operands(self, experts, dtype):
    return tuple((getattr(experts, w)[...], getattr(experts, f"{w}_scale")[...])
                 for w in WEIGHTS)

  def ragged_dot(self, rows_MK, w, sizes_X):
    q_XKN, scale_XGN = w
    if self.bits == 4:
      q_XKN = unpack_int4(q_XKN, q_XKN.ndim - 1)
    qtype = jnp.int4 if self.bits == 4 else jnp.int8
    qw = qwix.QArray(qvalue=q_XKN.astype(qtype), scale=scale_XGN.astype(rows_MK.dtype),
                     qtype=qtype)
    y = qwix.ragged_dot(rows_MK, qw, sizes_X, preferred_element_type=jnp.float32)
    return y.astype(rows_MK.dtype)


def attach_int_weights(name: str, experts: RoutedExperts, bits: int, group_size: int) -> None:
  """Turns the experts' wi / wo into integer levels + `wi_scale` / `wo_scale` (zeros until
  loaded); `name`: their module path, for the errors."""
  for w in WEIGHTS:
    shape, axes = _weight(experts, w)
    try:
      kshape, kdtype, sshape, saxes = int_layout(shape, axes, len(shape) - 2, 1, bits, group_size)
    except ValueError as e:
      raise ValueError(f"{name}/{w}: {e}") from None
    setattr(experts, w, nnx.Param(jnp.zeros(kshape, kdtype), logical_axes=axes))
    setattr(experts, f"{w}_scale", nnx.Param(jnp.zeros(sshape, jnp.float32), logical_axes=saxes))
  experts.quant = ExpertIntWeights(bits)


# ---- calibration -----------------------------------------------------------------------------------
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
                 for w, name in zip(super().operands(experts, dtype), WEIGHTS))

  def ragged_dot(self, rows_MK, w, sizes_X):
    w_XKN, probe_XKK = w
    return jax.lax.ragged_dot(_group_probe(rows_MK, sizes_X, probe_XKK), w_XKN, sizes_X)


def attach_probes(experts: RoutedExperts) -> None:
  """Adds a zero `wi_hessian_probe` / `wo_hessian_probe` [*lead, E, K, K] (fp32, replicated over
  K) to the experts."""
  for w in WEIGHTS:
    shape, axes = _weight(experts, w)
    setattr(experts, f"{w}_hessian_probe",
            nnx.Param(jnp.zeros((*shape[:-2], shape[-2], shape[-2]), jnp.float32),
                      logical_axes=(*axes[:-2], None, None)))
  experts.quant = ExpertProbe()
