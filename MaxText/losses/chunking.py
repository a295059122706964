"""How the chunked losses cut and distribute their work: the sequence cut into chunks, the mesh
axes that split the batch, a function of the batch run per batch shard (its sums added over the
shards), and the custom VJP that computes a loss's gradient in its forward pass."""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from MaxText.sharding.rules import current_context, logical_to_spec, without_rules


def chunks(x_BS_: jax.Array, chunk: int) -> jax.Array:
  """[B, S, ...] → [n, B, chunk, ...], zero-padded to n·chunk positions."""
  B, S = x_BS_.shape[:2]
  n = -(-S // chunk)
  pad = [(0, 0), (0, n * chunk - S)] + [(0, 0)] * (x_BS_.ndim - 2)
  x = jnp.pad(x_BS_, pad)
  return x.reshape(B, n, chunk, *x_BS_.shape[2:]).swapaxes(0, 1)


def batch_axes(ctx, rows: int) -> tuple[str, ...]:
  """The mesh axes that split a batch of `rows` rows ("activation_batch"), as a tuple."""
  axes = logical_to_spec(("activation_batch",), (rows,), ctx.rules, ctx.mesh)[0]
  return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def per_batch_shard(fn: Callable, params, *batch_arrays: jax.Array):
  """fn(params, *batch_arrays) run per shard of the batch axes under a mesh (`use_rules`); its
  outputs are sums, added over the shards. Without a mesh: fn itself."""
  ctx = current_context()
  if ctx is None:
    return fn(params, *batch_arrays)
  axes = batch_axes(ctx, batch_arrays[0].shape[0])
  if not axes:
    return fn(params, *batch_arrays)

  def local(p, *arrays):
    # the weights as per-device values: their gradient is then summed over the shards once, here,
    # instead of at each use inside fn's loop
    p = jax.tree.map(lambda x: jax.lax.pcast(x, axes, to="varying"), p)
    with without_rules():
      sums = fn(p, *arrays)
    return jax.tree.map(lambda x: jax.lax.psum(x, axes), sums)

  row_spec = P(axes)
  return jax.shard_map(local, mesh=ctx.mesh, axis_names=frozenset(axes),
                       in_specs=(P(), *(row_spec,) * len(batch_arrays)),
                       out_specs=P())(params, *batch_arrays)


def with_gradient_in_forward(sums_only: Callable, sums_and_grads: Callable) -> Callable:
  """(w, h) -> (loss sum, z-loss sum, count) with a custom VJP: `sums_only(w, h)` is the value,
  `sums_and_grads(w, h)` -> (sums, dw, dh) computes the loss sum's gradients in the forward pass
  and the backward pass only scales them by the incoming cotangent. The z-loss sum and the count
  are metrics (no gradient)."""
  @jax.custom_vjp
  def fused(w, h):
    return sums_only(w, h)

  def fused_fwd(w, h):
    sums, dw, dh = sums_and_grads(w, h)
    return sums, (dw, dh)

  def fused_bwd(res, g):
    dw, dh = res
    g_nll = g[0]
    return (jax.tree.map(lambda d: (g_nll * d).astype(d.dtype), dw),
            (g_nll * dh).astype(dh.dtype))

  fused.defvjp(fused_fwd, fused_bwd)

  def sums(w, h):
    nll, z, n = fused(w, h)
    return nll, jax.lax.stop_gradient(z), jax.lax.stop_gradient(n)
  return sums
