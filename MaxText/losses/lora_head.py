"""A LoRA'd LM head in the vocabulary-split token log-probabilities (`losses/loss_vocab_split.py`).

With adapters on the head (`lora_targets` matching it) the head computes h W + s (h A) B
(layers/lora.py; s = alpha / rank), and A [D, r] has no vocabulary axis, so the split (each
device a vocabulary slice of every weight the head reads) does not apply and the log-probs would
run unsplit. The low-rank term applied to the hidden state first makes the same logits one
projection whose only weight has the vocabulary axis:

    h W + s (h A) B  =  [h, s (h A)] @ [W; B]        hidden [.., D + r], kernel [D + r, V]

`fold_head_adapters` returns that head (the model's own head with its adapters taken off its
graph, its kernel replaced by [W; B]), its parameters, their logical axes and the widened hidden
state; the vocabulary split then takes it as any plain head. Gradients reach W, A, B and h through
the concatenations. Only used when the split applies (otherwise [W; B] would be a second copy of
the head weight for nothing)."""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx, traverse_util

from MaxText.layers import lora
from MaxText.layers.linear import DenseGeneral
from MaxText.losses.loss_parts import used_leaves
from MaxText.losses.loss_vocab_split import vocab_split_plan
from MaxText.models.model_def import ModelDef


def _head_adapter_parent(model_def: ModelDef, params, hidden_BSD: jax.Array) -> tuple | None:
  """The module path of the one LoRA'd projection the head reads, or None."""
  paths = [tuple(getattr(k, "key", getattr(k, "idx", k)) for k in p)
           for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  used = used_leaves(model_def.head, params, hidden_BSD[:, :1])
  parents = {p[:-1] for p, u in zip(paths, used) if u and lora.is_adapter(p)}
  return parents.pop() if len(parents) == 1 else None


def fold_head_adapters(model_def: ModelDef, params, hidden_BSD: jax.Array
                       ) -> tuple[Callable, Any, Any, jax.Array] | None:
  """(head, its parameters, their logical axes, hidden [B, S, D + r]) whose logits equal
  `model_def.head(params, hidden_BSD)` (module docstring), or None when the head reads no adapter
  (or its adapted projection is not one [D, V] kernel)."""
  parent = _head_adapter_parent(model_def, params, hidden_BSD)
  if parent is None:
    return None
  module = nnx.merge(model_def.graphdef, params)
  dense = dict(nnx.iter_graph(module)).get(parent)
  if not isinstance(dense, DenseGeneral) or dense.in_rank != 1 or dense.kernel[...].ndim != 2:
    return None
  w, a, b = dense.kernel[...], dense.lora_a[...], dense.lora_b[...]
  x = hidden_BSD.astype(dense.dtype)
  low_rank = (dense.lora_scale * (x @ a.astype(dense.dtype))).astype(dense.dtype)
  hidden_aug = jnp.concatenate([x, low_rank], axis=-1)
  dense.lora_a, dense.lora_b = nnx.data(None), nnx.data(None)   # the head without its adapters
  graphdef, state = nnx.split(module)
  flat = traverse_util.flatten_dict(nnx.to_pure_dict(state))
  kernel = [k for k in flat if k[:-1] == parent and flat[k] is not None]
  if len(kernel) != 1:
    return None
  flat[kernel[0]] = jnp.concatenate([w, b.astype(w.dtype)], axis=0)
  axes = {k: v for k, v in traverse_util.flatten_dict(model_def.logical_axes).items()
          if not (k[:-1] == parent and lora.is_adapter(k))}

  def head(p, h):
    return nnx.merge(graphdef, p).logits(h)

  return (head, traverse_util.unflatten_dict(flat), traverse_util.unflatten_dict(axes),
          hidden_aug)


def head_for_log_probs(model_def: ModelDef, params, hidden_BSD: jax.Array, chunk: int
                       ) -> tuple[Callable, Any, Any, jax.Array]:
  """(head, parameters, logical axes, hidden) for `chunked_target_log_probs`: the head with its
  adapters folded where that lets the vocabulary split apply, else the model's own."""
  plain = (model_def.head, params, model_def.logical_axes, hidden_BSD)
  if not 0 < chunk < hidden_BSD.shape[1] or not lora.split(params)[0]:
    return plain
  folded = fold_head_adapters(model_def, params, hidden_BSD)
  if folded is None or vocab_split_plan(*folded, chunk) is None:
    return plain
  return folded
