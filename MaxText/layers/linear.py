"""Parameter helpers: every parameter carries its logical axis names as `logical_axes` metadata.

`matmul(x_MK, w_KN)` is the one weight matmul of the dense layers. On the plain hot path
(`MaxText/backend/hot_path.py`: GPU, TPU) it is XLA's `jnp.dot(..., preferred_element_type=)`,
differentiated by autodiff. On the XLA:CPU-tuned path, in a low-precision compute dtype (bf16), it
runs every dot of the forward and backward pass with bf16 operands and fp32 accumulation, in the
operand layouts XLA:CPU's YNNPACK dot kernels take natively (a custom VJP with row-major operand
barriers). Written as plain `x @ w`, XLA:CPU would convert every bf16 operand to fp32 first (its
operand upcaster runs for any dot whose output is bf16, or whose operands are not row-major
[M, K] x [K, N] / [N, K]), so bf16 would be no faster than fp32 there.
"""
from __future__ import annotations

import functools
import itertools
import math
from typing import Any, Callable, Sequence, TypedDict

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from MaxText.backend import hot_path
from MaxText.layers.saved import saved
from MaxText.sharding.rules import current_context, logical_to_spec


class LayerKw(TypedDict):
  """The keywords a layer's parameters take from its model (`DenseGeneral(..., **kw)`): their
  generator, the compute dtype and the stored one."""
  rngs: nnx.Rngs
  dtype: jnp.dtype
  param_dtype: jnp.dtype


def param(rngs: nnx.Rngs, shape: Sequence[int], logical_axes: Sequence[str | None], *,
          std: float | None, dtype: jnp.dtype) -> nnx.Param:
  """Normal(0, std) init (std=None → ones, for norm scales). The std is kept as the parameter's
  `init_std` metadata: the model's init program draws every such parameter from a few large normal
  draws instead (`model_def.init_traced`)."""
  if std is None:
    return nnx.Param(jnp.ones(shape, dtype), logical_axes=tuple(logical_axes))
  value = (std * jax.random.normal(rngs.params(), tuple(shape), jnp.float32)).astype(dtype)
  return nnx.Param(value, logical_axes=tuple(logical_axes), init_std=float(std))


def dot_f32(a: jax.Array, b: jax.Array, contract: tuple[int, int]) -> jax.Array:
  """2-D dot over a's dim contract[0] and b's dim contract[1], accumulated and returned in fp32."""
  return jax.lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())),
                             preferred_element_type=jnp.float32)


def row_major_transpose(x: jax.Array) -> jax.Array:
  """x with its last two axes swapped, as a real row-major copy ([..., M, K] → [..., K, M]). A
  plain transpose is only a layout change that XLA folds into the consuming dot (contracting the
  second-to-last axis of an operand: a form YNNPACK does not take in bf16). Reshaping to
  [..., K, M, 1] makes the copy, the barrier keeps it; the trailing unit dim (not a flatten) keeps
  every axis's sharding expressible, so a batch-sharded x stays local (the dot's partial sums are
  reduced over the batch axes afterwards, as for any weight gradient)."""
  *lead, M, K = x.shape
  swapped = jnp.swapaxes(x, -1, -2).reshape(*lead, K, M, 1)
  return jax.lax.optimization_barrier(swapped).reshape(*lead, K, M)


def row_major(x: jax.Array) -> jax.Array:
  """x as a real row-major array. After transposes XLA keeps an array in a permuted layout, and a
  dot whose bf16 operand is not row-major is run in fp32; the reshape (to a trailing unit dim)
  makes the copy, the barrier keeps it."""
  return jax.lax.optimization_barrier(x.reshape(*x.shape, 1)).reshape(x.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _matmul_lowp(x_MK: jax.Array, w: jax.Array, w_is_NK: bool, out_dtype: jnp.dtype) -> jax.Array:
  return dot_f32(x_MK, w.astype(x_MK.dtype), (1, 1 if w_is_NK else 0)).astype(out_dtype)


def _matmul_lowp_fwd(x_MK, w, w_is_NK, out_dtype):
  return _matmul_lowp(x_MK, w, w_is_NK, out_dtype), (x_MK, w)


def _matmul_lowp_bwd(w_is_NK, out_dtype, res, dy_MN):
  del out_dtype
  x_MK, w = res
  dy_MN = dy_MN.astype(x_MK.dtype)
  w_lowp = w.astype(x_MK.dtype)
  dx_MK = dot_f32(dy_MN, w_lowp, (1, 0 if w_is_NK else 1)).astype(x_MK.dtype)
  if w_is_NK:   # w [N, K]: dw = dy^T x
    dw = dot_f32(row_major_transpose(dy_MN), x_MK, (1, 0))
  else:         # w [K, N]: dw = x^T dy
    dw = dot_f32(row_major_transpose(x_MK), dy_MN, (1, 0))
  return dx_MK, dw.astype(w.dtype)


_matmul_lowp.defvjp(_matmul_lowp_fwd, _matmul_lowp_bwd)

# Remat policies that keep weight-matmul outputs save this name (a custom_vjp hides the dot inside).
MATMUL_OUT = "matmul_out"


def matmul(x_MK: jax.Array, w: jax.Array, *, w_is_NK: bool = False,
           out_dtype: jnp.dtype | None = None) -> jax.Array:
  """x @ w (x @ w.T when `w_is_NK`, e.g. a tied embedding table [V, D]) computed in x's dtype,
  returned in `out_dtype` (default: x's dtype). `w` may be wider than x (fp32 master weights: its
  gradient stays fp32). Plain path: one XLA dot with the result in `out_dtype` (fp32 accumulation
  inside it), autodiff's gradients; tuned: `_matmul_lowp` (module docstring)."""
  out_dtype = x_MK.dtype if out_dtype is None else out_dtype
  if jnp.dtype(x_MK.dtype).itemsize >= 4:
    w = w.astype(x_MK.dtype)
    return (x_MK @ (w.T if w_is_NK else w)).astype(out_dtype)
  if not hot_path.tuned():
    w = w.astype(x_MK.dtype)
    y = jnp.dot(x_MK, w.T if w_is_NK else w, preferred_element_type=out_dtype)
    return checkpoint_name(y, MATMUL_OUT)
  return saved(_matmul_lowp(x_MK, w, w_is_NK, out_dtype), MATMUL_OUT)


def contract(x: jax.Array, w: jax.Array, in_rank: int, dtype: jnp.dtype,
             out_dtype: jnp.dtype | None = None) -> jax.Array:
  """x's last `in_rank` axes contracted with w's first `in_rank` (w [*in, *out]) in `dtype`, the
  result in `out_dtype` (default `dtype`): one `dot_general` with its accumulation in the result
  dtype, differentiated by autodiff — `matmul`'s plain path without the flattening to 2-D. A
  16-bit result is named `MATMUL_OUT` (for the remat policies), as `matmul` names it."""
  out_dtype = dtype if out_dtype is None else out_dtype
  dims = (tuple(range(x.ndim - in_rank, x.ndim)), tuple(range(in_rank)))
  y = jax.lax.dot_general(x.astype(dtype), w.astype(dtype), (dims, ((), ())),
                          preferred_element_type=out_dtype)
  return y if jnp.dtype(dtype).itemsize >= 4 else checkpoint_name(y, MATMUL_OUT)


class DenseGeneral(nnx.Module):
  """y = einsum(x, w): contracts the last `len(in_shape)` dims of x with w[in_shape + out_shape]."""
  # set by layers/quant.py on the projections it converts: integer weights' scales, calibration's
  # Hessian probe (declared here for the type checker; absent otherwise)
  kernel_scale: nnx.Param
  hessian_probe: nnx.Param

  def __init__(self, in_shape: Sequence[int], out_shape: Sequence[int],
               logical_axes: Sequence[str | None],
               *, rngs: nnx.Rngs, dtype: jnp.dtype, param_dtype: jnp.dtype):
    self.in_rank, self.out_rank = len(in_shape), len(out_shape)
    self.out_shape = tuple(out_shape)   # (a quantized kernel may be stored packed)
    # LoRA adapters (layers/lora.py sets them): y += lora_scale * (x A) B
    self.lora_a: nnx.Param | None = nnx.data(None)
    self.lora_b: nnx.Param | None = nnx.data(None)
    self.lora_scale = 0.0
    # a quantized matmul (layers/quant.py sets it): quant(self, x_MK, out_dtype) -> y_MN
    self.quant: Callable[[DenseGeneral, jax.Array, Any], jax.Array] | None = None
    fan_in = 1
    for d in in_shape:
      fan_in *= d
    self.kernel = param(rngs, (*in_shape, *out_shape), logical_axes, std=fan_in ** -0.5,
                        dtype=param_dtype)
    self.dtype = dtype

  def rows(self, x: jax.Array) -> tuple[tuple, jax.Array]:
    """(x's batch shape, x in the compute dtype as one 2-D [tokens, in] matrix)."""
    batch_shape = x.shape[: x.ndim - self.in_rank]
    return batch_shape, x.astype(self.dtype).reshape(-1, math.prod(x.shape[x.ndim - self.in_rank:]))

  def flat(self, x: jax.Array, out_dtype: jnp.dtype | None = None) -> jax.Array:
    """`self(x)` as ONE 2-D matmul [tokens, in] @ [in, out] on every path (the tuned path's
    form), for a decoding step on a TPU: there the multi-axis dot_general made XLA keep the q/k/v
    kernels heads-major ([H, D, E]), re-laying all of them before every decoding call, and copy
    the step's q into the row-major [B, H, E] the attention kernel reads; flat, the kernels are
    read as they are stored and the output is already row-major. A quantized or LoRA'd
    projection: `self(x)`."""
    if self.quant is not None or self.lora_a is not None:
      return self(x, out_dtype)
    batch_shape, x2 = self.rows(x)
    w = self.kernel[...]
    y = matmul(x2, w.reshape(x2.shape[1], -1), out_dtype=out_dtype)
    return y.reshape(*batch_shape, *w.shape[self.in_rank:])

  def __call__(self, x: jax.Array, out_dtype: jnp.dtype | None = None) -> jax.Array:
    """`out_dtype` (default: the compute dtype) is the dtype of the result, e.g. fp32 logits
    straight from the fp32 accumulator."""
    w = self.kernel[...]
    if self.quant is None and not hot_path.tuned():
      # XLA on GPU / TPU: one dot_general over the input axes as they are. Flattened to 2-D, an
      # input XLA holds in a permuted layout (the attention kernel's heads-major output, a
      # cotangent) is copied into row-major order first; the dot takes any layout as it is.
      y = contract(x, w, self.in_rank, self.dtype, out_dtype)
      if self.lora_a is not None:   # A [*in, r], B [r, *out]; zero B: y exactly as without
        assert self.lora_b is not None, "a LoRA'd projection has both adapters (layers/lora.py)"
        xa = contract(x, self.lora_a[...], self.in_rank, self.dtype, None)
        y = y + (self.lora_scale * contract(xa, self.lora_b[...], 1, self.dtype, None)
                 ).astype(y.dtype)
      return y
    # The tuned path (XLA:CPU): one 2-D matmul [tokens, in] @ [in, out]. XLA:CPU lays out and
    # differentiates a plain 2-D dot far better than a multi-dimensional dot_general, whose
    # backward transposes its cotangents.
    batch_shape, x2 = self.rows(x)
    in_size = x2.shape[1]
    if self.quant is not None:
      y = self.quant(self, x2, out_dtype)
      out_shape = self.out_shape
    elif self.lora_a is None:
      # the kernel as it is: a slice of its output axes works too (the chunked loss may split the
      # LM head over the vocabulary, MaxText/losses/chunked.py)
      y = matmul(x2, w.reshape(in_size, -1), out_dtype=out_dtype)
      out_shape = w.shape[self.in_rank:]
    else:   # A [*in, r], B [r, *out]; zero B: y exactly as without
      y = matmul(x2, w.reshape(in_size, -1), out_dtype=out_dtype)
      assert self.lora_b is not None, "a LoRA'd projection has both adapters (layers/lora.py)"
      a = self.lora_a[...].reshape(in_size, -1)
      b = self.lora_b[...].reshape(a.shape[1], -1)
      y = y + (self.lora_scale * matmul(matmul(x2, a), b)).astype(y.dtype)
      out_shape = self.out_shape
    return y.reshape(*batch_shape, *out_shape)


def _out_axes_split(layer: DenseGeneral) -> bool:
  """Whether the mesh splits any output axis of `layer`'s kernel (under `use_rules`)."""
  ctx = current_context()
  if ctx is None:
    return False
  shape = layer.kernel[...].shape
  axes = tuple(layer.kernel.logical_axes)[-len(shape):]
  spec = logical_to_spec(axes, shape, ctx.rules, ctx.mesh)
  for entry in spec[layer.in_rank:]:
    for a in () if entry is None else (entry,) if isinstance(entry, str) else entry:
      if ctx.mesh.shape[a] > 1:
        return True
  return False


def fused_dense(layers: Sequence[DenseGeneral], x: jax.Array,
                out_dtype: jnp.dtype | None = None) -> list[jax.Array]:
  """`[layer(x) for layer in layers]` (projections of one input with the same input shape, e.g.
  q/k/v or gate/up) as ONE matmul over their kernels concatenated along the output axis inside
  the step (parameters stay separate). One [tokens, in] x [in, sum of outs] dot runs faster on
  XLA:CPU than several narrow ones in a 16-bit compute dtype; in fp32 the concatenation costs more
  than it saves, so fp32 keeps separate matmuls and its numerics (A/Bs: benchmarks/ab_step.py).
  Each layer alone also when
  one has a LoRA adapter or a quantized kernel, or when the mesh splits an output axis
  (concatenating split axes would need communication), and on the plain hot path (XLA on GPU/TPU
  runs each projection as its own dot: no concatenated kernel to build every step)."""
  if (jnp.dtype(layers[0].dtype).itemsize >= 4 or not hot_path.tuned()
      or any(l.quant is not None or l.lora_a is not None for l in layers)
      or any(_out_axes_split(l) for l in layers)):
    return [l(x, out_dtype) for l in layers]
  batch_shape, x2 = layers[0].rows(x)
  kernels = [l.kernel[...].reshape(x2.shape[1], -1) for l in layers]
  y = matmul(x2, jnp.concatenate(kernels, axis=1), out_dtype=out_dtype)
  ends = tuple(itertools.accumulate(k.shape[1] for k in kernels))[:-1]
  return [part.reshape(*batch_shape, *l.out_shape)
          for l, part in zip(layers, _split_columns(y, ends))]


def concat_bits(parts: Sequence[jax.Array], axis: int) -> jax.Array:
  """`jnp.concatenate(parts, axis)`; 16-bit floats as their raw bits (XLA:CPU has no bf16
  concatenate: its float normalisation would convert every part to fp32 and back); on the plain
  hot path the plain concatenate."""
  if jnp.dtype(parts[0].dtype).itemsize != 2 or not hot_path.tuned():
    return jnp.concatenate(parts, axis=axis)
  bits = [jax.lax.bitcast_convert_type(p, jnp.uint16) for p in parts]
  return jax.lax.bitcast_convert_type(jnp.concatenate(bits, axis=axis), parts[0].dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _split_columns(y: jax.Array, ends: tuple[int, ...]) -> tuple[jax.Array, ...]:
  """`jnp.split(y, ends, axis=1)` whose gradient concatenates as `concat_bits` does."""
  return tuple(jnp.split(y, ends, axis=1))


def _split_columns_fwd(y, ends):
  return _split_columns(y, ends), None


def _split_columns_bwd(ends, _, cotangents):
  return (concat_bits(cotangents, 1),)


_split_columns.defvjp(_split_columns_fwd, _split_columns_bwd)
