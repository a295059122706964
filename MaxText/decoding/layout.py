"""Decoding's parameter layout: a scanned model's parameters restacked per layer.

A scanned layer stack (`scan_layers=true`, MaxText/layers/stack.py) holds each run's layers in
arrays with a leading "layers" axis and runs them in a `lax.scan`; inside a decoding program (a
`while_loop` of steps) that loop slices — copies — every layer's weights out of the stack on
every step, a second pass over the weights where a decoding step is bound by reading them once.
Restacked (`per_layer`), the same values are the parameters of the unscanned model (the same
family built with `scan_layers=false`: `layers/<i>/...`, one array per layer), whose programs run
the layers one after another and read each weight in place: what the engine decodes with when
`decode_unroll_layers` is on (the tools restack once, at load). The numbers are the scan's.

`Layout` knows both forms of one model: which one a parameter tree is in, the unscanned model's
definition, and the restacking (run r's member m at repeat k is layer run.start + k x
len(block) + m of its stack, for every stack of the model, the vision and audio towers' too).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from flax import nnx, traverse_util

from MaxText.layers.stack import PatternStack
from MaxText.models.model_config import ModelConfig
from MaxText.models.model_def import ModelDef
from MaxText.models.registry import make_model_def


class Layout:
  """The scanned (`model_def`, the parameters' layout everywhere else) and per-layer forms of the
  parameters of `mcfg` (module docstring)."""

  def __init__(self, mcfg: ModelConfig, model_def: ModelDef):
    self.mcfg, self.model_def = mcfg, model_def
    self.scanned = mcfg.scan_layers
    self._structure = jax.tree.structure(model_def.abstract_params)

  @functools.cached_property
  def unscanned_def(self) -> ModelDef:
    """The model built with scan_layers=false (the model itself when it is not scanned)."""
    if not self.scanned:
      return self.model_def
    return make_model_def(dataclasses.replace(self.mcfg, scan_layers=False))

  @functools.cached_property
  def _unscanned_structure(self):
    return jax.tree.structure(self.unscanned_def.abstract_params)

  def is_per_layer(self, params) -> bool:
    """Whether `params` are in the per-layer form (else the model's own, or not this model's:
    ValueError)."""
    structure = jax.tree.structure(params)
    if structure == self._structure:
      return not self.scanned
    if self.scanned and structure == self._unscanned_structure:
      return True
    raise ValueError("the parameters are not this model's: their tree is neither its scanned nor "
                     "its per-layer layout")

  def def_of(self, params) -> ModelDef:
    """The model definition whose parameters `params` are."""
    return self.unscanned_def if self.is_per_layer(params) else self.model_def

  @functools.cached_property
  def _stacks(self) -> list[tuple[tuple, Any]]:
    """(path, plan) of every scanned stack of the model."""
    model = nnx.merge(self.model_def.graphdef, self.model_def.abstract_params)
    return [(tuple(path), node.plan) for path, node in nnx.iter_graph(model)
            if isinstance(node, PatternStack) and node.scan]

  def mapping(self) -> dict[tuple, tuple[tuple, int | None]]:
    """Per-layer path → (scanned path, index on its leading axis or None: the same array)."""
    out = {}
    for path in traverse_util.flatten_dict(self.model_def.abstract_params):
      for at, plan in self._stacks:
        n = len(at)
        if path[:n] == at and len(path) > n + 2 and path[n] == "runs":
          run = plan[int(path[n + 1])]
          m, rest = int(path[n + 2]), path[n + 3:]
          for k in range(run.repeats):
            out[(*at, "layers", run.start + k * len(run.block) + m, *rest)] = (path, k)
          break
      else:
        out[path] = (path, None)
    return out

  def per_layer(self, params, shardings=None, consume: bool = False):
    """`params` (either form) in the per-layer form, each array placed with its sharding in
    `shardings` (the per-layer tree's; None: as the slice comes). `consume`: each stacked array
    is deleted once its layers are cut from it (the caller holds no other reference), so the
    restacking needs one array's room, not the whole model's again."""
    if not self.scanned or self.is_per_layer(params):
      return params
    flat: dict = traverse_util.flatten_dict(params)
    want: dict[tuple, Any] = traverse_util.flatten_dict(self.unscanned_def.abstract_params)
    mapping = self.mapping()
    if set(mapping) != set(want):
      raise ValueError("the per-layer layout of this model does not match its scanned one: "
                       f"{sorted(set(mapping) ^ set(want), key=str)[:3]}")
    sh = None if shardings is None else traverse_util.flatten_dict(shardings)
    place = (lambda x, p: x) if sh is None else (lambda x, p: jax.device_put(x, sh[p]))
    by_source: dict[tuple, list[tuple[tuple, int | None]]] = {}
    for path, (source, k) in mapping.items():
      by_source.setdefault(source, []).append((path, k))
    out = {}
    for source, targets in by_source.items():
      x = flat[source]
      for path, k in targets:
        out[path] = place(x if k is None else x[k], path)
        if out[path].shape != want[path].shape:
          raise ValueError(f"{'/'.join(map(str, path))}: restacked to {out[path].shape}, the "
                           f"per-layer model's is {want[path].shape}")
      if consume and any(k is not None for _, k in targets) and isinstance(x, jax.Array):
        jax.block_until_ready([out[p] for p, _ in targets])
        x.delete()
    return traverse_util.unflatten_dict(out)
