"""A LoRA'd LM head in the vocabulary-split token log-probabilities (`losses/vocab_split.py`).

With adapters on the head (`lora_targets` matching it) the head computes h W + s (h A) B
(layers/lora.py; s = alpha / rank), and A [D, r] has no vocabulary axis, so the split (each
device a vocabulary slice of every weight the head reads) does not apply and the log-probs would
run unsplit. Applying the low-rank term's first half to the hidden state first leaves a head
whose weights all have the vocabulary axis:

    h W + s (h A) B  =  x W + z B,   [x, z] = [h, s (h A)]   hidden [.., D + r]; W [D, V], B [r, V]

`fold_head_adapters` returns that head (the model's own, its adapted projection replaced by one
that reads W and B as they are, A taken off), its parameters (the model's, less A), their logical
axes and the widened hidden state; the vocabulary split then takes it as any plain head. W and B
stay two leaves with their own shardings, so each one's gradient leaves the split in its own
layout (a concatenated [W; B] kernel would be a copy of the head per step, with a layout of its
own that the mesh may not divide: then gathered whole). Gradients reach A and h through z. Only
used when the split applies."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, traverse_util

from MaxText.layers import lora
from MaxText.layers.linear import DenseGeneral, matmul
from MaxText.losses.vocab_split import vocab_split_plan
from MaxText.models.model_def import Head, ModelDef, leaf_paths


class _FoldedProjection(nnx.Module):
  """A LoRA'd [D, V] projection with its A applied beforehand: [x, z] [.., D + r] -> x W + z B,
  each product straight from its accumulator in `out_dtype` (W, B: the same parameters)."""

  def __init__(self, kernel: nnx.Param, lora_b: nnx.Param, dtype):
    self.kernel, self.lora_b, self.dtype = kernel, lora_b, dtype

  def __call__(self, xz: jax.Array, out_dtype: jnp.dtype | None = None) -> jax.Array:
    w, b = self.kernel[...], self.lora_b[...]
    xz_MK = xz.astype(self.dtype).reshape(-1, xz.shape[-1])
    D = w.shape[0]
    y = (matmul(xz_MK[:, :D], w, out_dtype=out_dtype)
         + matmul(xz_MK[:, D:], b, out_dtype=out_dtype))
    return y.reshape(*xz.shape[:-1], w.shape[-1])


def _head_adapter_parent(model_def: ModelDef, params) -> tuple | None:
  """The module path of the one LoRA'd projection among the head's weights, or None."""
  parents = {p[:-1] for p, u in zip(leaf_paths(params), model_def.head.reads(params))
             if u and lora.is_adapter(p)}
  return parents.pop() if len(parents) == 1 else None


def fold_head_adapters(model_def: ModelDef, params, hidden_BSD: jax.Array
                       ) -> tuple[Head, Any, Any, jax.Array] | None:
  """(head, its parameters, their logical axes, hidden [B, S, D + r]) whose logits equal
  `model_def.head(params, hidden_BSD)` (module docstring), or None when the head reads no adapter
  (or its adapted projection is not one plain [D, V] kernel)."""
  parent = _head_adapter_parent(model_def, params)
  if parent is None or not parent or not isinstance(parent[-1], str):
    return None
  module = nnx.merge(model_def.graphdef, params)
  graph = dict(nnx.iter_graph(module))
  dense = graph.get(parent)
  if (not isinstance(dense, DenseGeneral) or dense.quant is not None or dense.in_rank != 1
      or dense.kernel[...].ndim != 2 or dense.lora_a is None or dense.lora_b is None):
    return None
  x = hidden_BSD.astype(dense.dtype)
  z = (dense.lora_scale * (x @ dense.lora_a[...].astype(dense.dtype))).astype(dense.dtype)
  folded = _FoldedProjection(dense.kernel, dense.lora_b, dense.dtype)
  setattr(graph[parent[:-1]], parent[-1], folded)   # A off the graph
  graphdef, state = nnx.split(module)

  def kept(k):
    return not (k[:-1] == parent and k[-1] == "lora_a")
  flat = traverse_util.flatten_dict(nnx.to_pure_dict(state))
  axes = traverse_util.flatten_dict(model_def.logical_axes)
  if set(flat) != {k for k in axes if kept(k)}:
    return None

  def logits(p, h):
    with model_def.traced():
      return nnx.merge(graphdef, p).logits(h)
  return (Head(logits, (parent,)), traverse_util.unflatten_dict(flat),
          traverse_util.unflatten_dict({k: v for k, v in axes.items() if kept(k)}),
          jnp.concatenate([x, z], axis=-1))


def head_for_log_probs(model_def: ModelDef, params, hidden_BSD: jax.Array, chunk: int
                       ) -> tuple[Head, Any, Any, jax.Array]:
  """(head, parameters, logical axes, hidden) for `chunked_target_log_probs`: the head with its
  adapters folded where that lets the vocabulary split apply, else the model's own."""
  plain = (model_def.head, params, model_def.logical_axes, hidden_BSD)
  if not 0 < chunk < hidden_BSD.shape[1] or not lora.split(params)[0]:
    return plain
  folded = fold_head_adapters(model_def, params, hidden_BSD)
  if folded is None or vocab_split_plan(*folded, chunk) is None:
    return plain
  return folded
