"""Multi-token prediction (MTP): the block a model carries besides its decoder (DeepSeek-V3,
Qwen3-Next's `mtp.*`).

Conventions: B batch, S sequence, D model width.

Depth k (1-based, `mtp_num_layers` depths) at position t combines the previous depth's hidden
state h^{k-1}_t (depth 0: the decoder's final-norm output) with the embedding of the token k
ahead, x_{t+k}:
    u = fc([norm_emb(emb(x_{t+k})) | norm_hidden(h^{k-1}_t)])      fc: [2D] -> [D]
    h^k_t = norm(layer_{k-1}(u))                                   causal, positions t
and the model's shared head on h^k_t predicts x_{t+k+1}. The projection and the three norms are
shared by the depths, each depth has its own decoder layer (the layout of Qwen3-Next's released
checkpoints: mtp.fc, mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, mtp.layers.{j}, mtp.norm;
the embedding comes first in the concatenation, as vLLM's Qwen3-Next MTP runs it). The layers are
the family's own decoder layers; the family runs them (`models/llama/model.py`).
"""
from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

import jax.numpy as jnp
from flax import nnx

from MaxText.layers.linear import DenseGeneral


class MTPLayer(Protocol):
  """A depth's layer as the family runs it: its decoder layer's forward and decoding step."""

  def __call__(self, carry, positions_BS, segment_ids_BS, per_layer=None) -> tuple[Any, Any]: ...

  def extend(self, carry, positions_BS, valid_BS, prefill, per_layer) -> tuple[Any, Any]: ...


def shifted(tokens_BS, k: int, fill: int = 0):
  """tokens[:, t + k] at t (`fill` past the row's end)."""
  return jnp.pad(tokens_BS[:, k:], ((0, 0), (0, k)), constant_values=fill)


class MTPBlock(nnx.Module):
  """The shared projection and norms and the per-depth layers (module docstring)."""

  def __init__(self, dim: int, norm: Callable[[], nnx.Module], layers: Sequence[MTPLayer], *,
               rngs: nnx.Rngs, dtype, param_dtype):
    self.fc = DenseGeneral((2 * dim,), (dim,), ("mlp", "embed"), rngs=rngs, dtype=dtype,
                           param_dtype=param_dtype)
    self.pre_fc_norm_embedding = norm()
    self.pre_fc_norm_hidden = norm()
    self.layers: nnx.List[MTPLayer] = nnx.List(list(layers))
    self.norm = norm()

  def combine(self, emb_BSD, hidden_BSD):
    """fc([norm_emb(emb) | norm_hidden(hidden)]): a depth's input to its layer."""
    e_BSD = self.pre_fc_norm_embedding(emb_BSD)
    h_BSD = self.pre_fc_norm_hidden(hidden_BSD).astype(e_BSD.dtype)
    return self.fc(jnp.concatenate([e_BSD, h_BSD], axis=-1))
