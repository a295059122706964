"""A stack of identical decoder layers, run either by `jax.lax.scan` over stacked parameters
(`scan_layers=true`: one compiled layer body, leading "layers" axis on every parameter) or as an
unrolled Python loop; each layer call is wrapped in `jax.checkpoint` per `remat_policy`."""
from __future__ import annotations

from typing import Callable

import jax
from flax import nnx

REMAT_POLICIES: dict[str, Callable | None] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    # keep the outputs of the weight matmuls (projections, MLP) and the flash-attention kernel's
    # residuals (output + log-sum-exp); recompute the rest
    "save_matmuls": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names("flash_out", "flash_lse")),
}


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

  def _wrap(self, fn):
    if self.remat_policy == "none":
      return fn
    return jax.checkpoint(fn, policy=REMAT_POLICIES[self.remat_policy], prevent_cse=not self.scan)

  def __call__(self, x, *args):
    def run_one(graphdef, state, x):
      return nnx.merge(graphdef, state)(x, *args)

    if self.scan:
      graphdef, state = nnx.split(self.layers)
      body = self._wrap(lambda carry, layer_state: (run_one(graphdef, layer_state, carry), None))
      x, _ = jax.lax.scan(body, x, state)
      return x
    for layer in self.layers:
      graphdef, state = nnx.split(layer)
      x = self._wrap(lambda s, x, g=graphdef: run_one(g, s, x))(state, x)
    return x
