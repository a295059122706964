"""A stack of identical decoder layers, run either by `jax.lax.scan` over stacked parameters
(`scan_layers=true`: one compiled layer body, leading "layers" axis on every parameter) or as an
unrolled Python loop; each layer call is wrapped in `jax.checkpoint` per `remat_policy`.

A layer is called `layer(carry, *args) -> carry`; the carry is any pytree (the hidden state, or the
hidden state plus K/V handed to later layers). `xs`, when given, is a pytree of per-layer inputs
with a leading axis of length num_layers: layer i is then called
`layer(carry, *args, per_layer=xs[i])`."""
from __future__ import annotations

from typing import Callable

import jax
from flax import nnx

REMAT_POLICIES: dict[str, Callable | None] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    # keep the outputs of the weight matmuls (projections, MLP; `matmul_out`: the bf16 ones) and the
    # flash-attention kernels' residuals (output + log-sum-exp: ours, and splash's on TPU);
    # recompute the rest
    "save_matmuls": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names("matmul_out", "flash_out", "flash_lse",
                                                      "splash_residuals")),
}


def remat(fn: Callable, policy: str, *, prevent_cse: bool = True) -> Callable:
  if policy == "none":
    return fn
  return jax.checkpoint(fn, policy=REMAT_POLICIES[policy], prevent_cse=prevent_cse)


def _prepend_layers_axis(module: nnx.Module) -> None:
  for _, var in nnx.iter_graph(module):
    if isinstance(var, nnx.Variable) and "logical_axes" in var.get_metadata():
      axes = var.get_metadata()["logical_axes"]
      if len(axes) + 1 == len(var.get_value().shape):
        var.set_metadata("logical_axes", ("layers", *axes))


class LayerStack(nnx.Module):
  """`make_layer(rngs)` builds one layer; the layer is called as `layer(x, *args) -> x`."""

  def __init__(self, make_layer: Callable[[nnx.Rngs], nnx.Module], num_layers: int, *,
               scan: bool, remat_policy: str, rngs: nnx.Rngs):
    self.scan = scan
    self.remat_policy = remat_policy
    if scan:
      @nnx.split_rngs(splits=num_layers)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def make_stacked(r):
        return make_layer(r)
      self.layers = make_stacked(rngs)
      _prepend_layers_axis(self.layers)
    else:
      self.layers = nnx.List([make_layer(rngs) for _ in range(num_layers)])

  def __call__(self, carry, *args, xs=None):
    if self.scan:
      graphdef, state = nnx.split(self.layers)
      body = remat(lambda c, inp: (_call(graphdef, inp[0], c, args, inp[1]), None),
                   self.remat_policy, prevent_cse=False)
      carry, _ = jax.lax.scan(body, carry, (state, xs))
      return carry
    return run_unrolled(self.layers, carry, args, xs, self.remat_policy)


def run_unrolled(layers, carry, args: tuple, xs, remat_policy: str):
  """Layers (possibly all different) one after another, each wrapped per `remat_policy`."""
  for i, layer in enumerate(layers):
    graphdef, state = nnx.split(layer)
    x_i = None if xs is None else jax.tree.map(lambda a, i=i: a[i], xs)
    carry = remat(lambda s, c, x, g=graphdef: _call(g, s, c, args, x), remat_policy)(state, carry, x_i)
  return carry


def _call(graphdef, state, carry, args: tuple, x_i):
  layer = nnx.merge(graphdef, state)
  return layer(carry, *args) if x_i is None else layer(carry, *args, per_layer=x_i)


class LayerList(nnx.Module):
  """Unrolled layers that need not be identical (same calling convention as LayerStack)."""

  def __init__(self, layers: list[nnx.Module], *, remat_policy: str):
    self.layers = nnx.List(layers)
    self.remat_policy = remat_policy

  def __call__(self, carry, *args, xs=None):
    return run_unrolled(self.layers, carry, args, xs, self.remat_policy)
