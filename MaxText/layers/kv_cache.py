"""Decoding caches: what a layer keeps between decoding steps, declared by its family.

Conventions
  B batch, S new tokens of this call, T cache slots, K kv heads, E head dim, H query heads,
  G = H / K query heads per kv head. Arrays are named by shape (`k_BKTE`).

A family's `decode_cache(mcfg)` (MaxText/models/family.py) gives its cache groups: `{name:
CacheGroup(kind, layers)}`, `layers` layers of one kind whose arrays are stacked on a leading
"layers" axis. A layer writes and reads its own row of its group (`index`); a layer that shares
another layer's K/V (Gemma 4's KV-shared tail) reads its producer's row and stores nothing.
Generic decoding code (MaxText/decoding/) only allocates the groups — shapes, dtypes and logical
axes from `kind.arrays(batch, max_len, dtype)` — and hands them to the model; it never looks
inside.
A family with another kind of state (e.g. the recurrent and convolution state of linear-attention
layers) defines its own kind with the same `arrays` method.

`KVCache` is an attention layer's keys and values:
  full attention      k, v [B, K, T, E] with T the cache length; slot = position (kv heads before
                      the length: the layout attention reads without a transpose).
  sliding window W    a ring buffer of R = min(W, T) slots (slot = position mod R) plus the position
                      each slot holds, pos [B, R] (-1 = empty): memory O(W), not O(length).
`write` stores the valid tokens of a call (a prefill keeps only the last R of a long prompt in a
ring); `attend` lets queries see what the cache holds after that write — a decoding step writes
its one token first, then attends, so a ring of W slots always holds the window q - W < k <= q.

A prompt prefilled in pieces (chunked prefill: a piece of S tokens as a multi-token step over the
cache) would overwrite, in a ring of W slots, keys its own first queries still need. A kind's
optional `widen(group, extra, starts_B)` / `narrow(group, like)` handle that around a piece:
the ring re-laid as a ring of W + S slots (slot = position mod (W + S), only the positions before
the piece's start: anything else a slot held is a previous request's), which the piece's write
then fills without dropping a key any of its queries reads, and afterwards the ring of W slots
again, holding the latest position of each slot: exactly the ring a whole-prompt prefill leaves.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from MaxText.kernels.decode_attention import decode_attention

CACHE_BKTE = ("activation_batch", "activation_kv_heads", None, None)


def select_decode_attention(name: str, platform: str) -> str:
  """The `decode_attention` key on a platform: auto is the Pallas kernel on a TPU (where it reads
  only the live cache blocks and stores the step's K/V itself: faster at every batch measured),
  the einsums elsewhere (a CPU would interpret the kernel)."""
  if name == "auto":
    return "pallas" if platform == "tpu" else "xla"
  return name
CACHE_BT = ("activation_batch", None)


@dataclass(frozen=True)
class ArraySpec:
  """One array of one layer's cache (the group adds a leading "layers" axis)."""
  shape: tuple[int, ...]
  dtype: Any
  logical_axes: tuple[str | None, ...]
  fill: int = 0     # the value of an empty cache


class CacheKind(Protocol):
  def arrays(self, batch: int, max_len: int, dtype: Any) -> dict[str, ArraySpec]:
    """The arrays one layer of this kind keeps for `batch` rows of up to `max_len` positions;
    `dtype` is the cache dtype (state that must stay exact, e.g. positions, ignores it)."""
    ...


@dataclass(frozen=True)
class CacheGroup:
  kind: Any       # a CacheKind
  layers: int     # rows of the stacked arrays


@dataclass(frozen=True)
class KVCache:
  """Keys and values of attention layers; `window` > 0: a sliding-window ring buffer. `kernel`
  (the `decode_attention` key): "pallas" runs a one-token step over a full-attention cache with
  MaxText/kernels/decode_attention.py (only the blocks holding live positions read, the step's
  K/V stored by the kernel), "xla" the einsums below, "auto" as `select_decode_attention` on the
  default backend (a ModelConfig holds it resolved already)."""
  kv_heads: int
  head_dim: int
  window: int = 0
  kernel: str = "xla"

  @property
  def rolls_back_by_position(self) -> bool:
    """Whether tokens written past a point are undone by writing over them (full attention: slot
    = position, a query sees only keys at positions <= its own, each rewritten before it is read;
    not a ring buffer, whose slots hold older positions too). A kind without this property is
    rolled back by running again from a copy (MaxText/decoding/speculative.py)."""
    return not self.window

  def _pallas(self) -> bool:
    return select_decode_attention(self.kernel, jax.default_backend()) == "pallas"

  def slots(self, max_len: int) -> int:
    return min(self.window, max_len) if self.window else max_len

  def arrays(self, batch: int, max_len: int, dtype: Any) -> dict[str, ArraySpec]:
    T = self.slots(max_len)
    kv = ArraySpec((batch, self.kv_heads, T, self.head_dim), dtype, CACHE_BKTE)
    out = {"k": kv, "v": kv}
    if self.window:
      out["pos"] = ArraySpec((batch, T), jnp.int32, CACHE_BT, fill=-1)
    return out

  def widen(self, group: dict, extra: int, starts_B) -> dict:
    """A ring's stacked `group` (arrays [L, B, ...]) as a ring of `extra` more slots holding the
    same positions, those before `starts_B` only (module docstring); full attention: unchanged."""
    if not self.window:
      return group
    pos_LBT = group["pos"]
    L, B, T = pos_LBT.shape
    keep_LBT = (pos_LBT >= 0) & (pos_LBT < starts_B[None, :, None])
    return self._relaid(group, jnp.where(keep_LBT, pos_LBT % (T + extra), T + extra), T + extra)

  def narrow(self, group: dict, like: dict[str, ArraySpec]) -> dict:
    """A ring's stacked `group` as the ring of `like`'s shapes (its slots fewer), each slot
    holding the latest position of its residue (after a piece: the window the next query reads);
    full attention: unchanged."""
    if not self.window:
      return group
    slots = like["pos"].shape[-1]
    pos_LBT = group["pos"]
    L, B, _ = pos_LBT.shape
    target_LBT = jnp.where(pos_LBT >= 0, pos_LBT % slots, slots)
    latest_LBT = jnp.full((L, B, slots), -1, jnp.int32).at[
        jnp.arange(L)[:, None, None], jnp.arange(B)[None, :, None], target_LBT].max(
            pos_LBT, mode="drop")
    held_LBT = jnp.take_along_axis(latest_LBT, jnp.minimum(target_LBT, slots - 1), axis=-1)
    mine_LBT = (pos_LBT >= 0) & (held_LBT == pos_LBT)
    return self._relaid(group, jnp.where(mine_LBT, target_LBT, slots), slots)

  @staticmethod
  def _relaid(group: dict, slot_LBT, slots: int) -> dict:
    """A ring of `slots` slots with each entry of `group` moved to its `slot_LBT` (>= slots:
    dropped); slots nothing moves to are empty (position -1)."""
    k = group["k"]
    L, B, K, _, E = k.shape
    l_L111, b_1B11 = jnp.arange(L)[:, None, None, None], jnp.arange(B)[None, :, None, None]
    h_11K1 = jnp.arange(K)[None, None, :, None]
    at = (l_L111, b_1B11, h_11K1, slot_LBT[:, :, None, :])
    out = {name: jnp.zeros((L, B, K, slots, E), group[name].dtype).at[at].set(group[name],
                                                                               mode="drop")
           for name in ("k", "v")}
    out["pos"] = jnp.full((L, B, slots), -1, jnp.int32).at[
        l_L111[..., 0], b_1B11[..., 0], slot_LBT].set(group["pos"], mode="drop")
    return out

  def write(self, group: dict, index, k_BSKE, v_BSKE, positions_BS, valid_BS) -> dict:
    """`group` with the valid tokens' k/v stored in row `index` (invalid ones are dropped)."""
    B, S = positions_BS.shape
    T = group["k"].shape[3]
    if self.window:
      last_B = jnp.max(jnp.where(valid_BS, positions_BS, -1), axis=1)
      keep_BS = valid_BS & (positions_BS > last_B[:, None] - T)    # the last T tokens at most
      slot_BS = jnp.where(keep_BS, positions_BS % T, T)
    else:
      slot_BS = jnp.where(valid_BS, positions_BS, T)               # T (or beyond): dropped
    rows_B11 = jnp.arange(B)[:, None, None]
    heads_1K1 = jnp.arange(self.kv_heads)[None, :, None]
    at_BKS = (index, rows_B11, heads_1K1, slot_BS[:, None, :])   # broadcast to [B, K, S]
    out = {name: group[name].at[at_BKS].set(x.transpose(0, 2, 1, 3).astype(group[name].dtype),
                                            mode="drop")
           for name, x in (("k", k_BSKE), ("v", v_BSKE))}
    if self.window:
      out["pos"] = group["pos"].at[index, rows_B11[:, :, 0], slot_BS].set(positions_BS,
                                                                          mode="drop")
    return out

  def extend(self, group: dict | None, index, op, q_BSHE, k_BSKE, v_BSKE, positions_BS, valid_BS,
             *, prefill: bool, scale: float) -> tuple[jax.Array, dict | None]:
    """One attention layer's decoding: the new K/V stored in row `index` of `group` (None: no
    cache, e.g. scoring); a prefill (positions 0..S-1) attends within the new tokens with the
    training op `op`, a step over the cache after its write. Returns (o_BSHE, group)."""
    B, S = positions_BS.shape
    if self._pallas() and not self.window and S == 1 and not prefill and group is not None:
      # the step's K/V stored by the kernel itself, in the cache blocks it reads anyway (XLA's
      # scatter of B x K rows runs them one DMA round trip at a time: ~45 us a layer at batch 32
      # on a v5e, its static schedule)
      q_BKGE = q_BSHE.reshape(B, self.kv_heads, -1, q_BSHE.shape[-1])
      T = group["k"].shape[3]
      o_BKGE, k, v = decode_attention(
          q_BKGE, group["k"], group["v"], index, positions_BS[:, 0] + 1, scale=scale,
          new_kv=(k_BSKE[:, 0], v_BSKE[:, 0], jnp.where(valid_BS[:, 0], positions_BS[:, 0], T)))
      return o_BKGE.reshape(q_BSHE.shape), {**group, "k": k, "v": v}
    if group is not None:
      group = self.write(group, index, k_BSKE, v_BSKE, positions_BS, valid_BS)
    if prefill:
      return op(q_BSHE, k_BSKE, v_BSKE, valid_BS.astype(jnp.int32), scale=scale), group
    if group is None:
      raise ValueError("a decoding step after the prefill attends over the cache: group is None")
    return self.attend(group, index, q_BSHE, positions_BS, scale=scale), group

  def attend(self, group: dict, index, q_BSHE, positions_BS, *, scale: float) -> jax.Array:
    """Attention of queries at `positions_BS` over row `index` of the cache: keys at positions
    <= the query's (and > query - window): softmax in fp32, GQA without repeating K/V."""
    B, S, H, E = q_BSHE.shape
    L, _, K, T, _ = group["k"].shape
    G = H // K
    if self._pallas() and not self.window and S == 1:
      # keys 0 .. the query's position: slot = position in a full-attention cache
      o_BKGE = decode_attention(q_BSHE.reshape(B, K, G, E), group["k"], group["v"], index,
                                positions_BS[:, 0] + 1, scale=scale)
      return o_BKGE.reshape(B, S, H, E)
    # rows and kv heads merged into ONE batch axis N = B x K before the layer's row is cut (a
    # reshape of the stacked cache, no copy; merged after the cut, XLA on a TPU copies the row
    # out): with one batch axis the TPU's program fuses the softmax's max into the scores'
    # matmul, ~10 % fewer estimated cycles for the attention (benchmarks/tpu_aot_decode.py)
    N, Q = B * K, G * S
    k_NTE = group["k"].reshape(L, N, T, E)[index].astype(q_BSHE.dtype)
    v_NTE = group["v"].reshape(L, N, T, E)[index].astype(q_BSHE.dtype)
    if self.window:
      key_pos_BT = group["pos"][index]
    else:
      key_pos_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
    q_pos_BS1 = positions_BS[:, :, None]
    mask_BST = (key_pos_BT[:, None, :] >= 0) & (key_pos_BT[:, None, :] <= q_pos_BS1)
    if self.window:
      mask_BST &= key_pos_BT[:, None, :] > q_pos_BS1 - self.window
    # heads-major: the G query heads of one kv head folded into the query rows (row g*S + s)
    q_NQE = q_BSHE.reshape(B, S, K, G, E).transpose(0, 2, 3, 1, 4).reshape(N, Q, E)
    scores_NQT = jnp.einsum("nqe,nte->nqt", q_NQE, k_NTE,
                            preferred_element_type=jnp.float32) * scale
    mask_NQT = jnp.broadcast_to(jnp.tile(mask_BST, (1, G, 1))[:, None],
                                (B, K, Q, T)).reshape(N, Q, T)
    scores_NQT = jnp.where(mask_NQT, scores_NQT, jnp.finfo(jnp.float32).min)
    probs_NQT = jax.nn.softmax(scores_NQT, axis=-1).astype(v_NTE.dtype)
    out_NQE = jnp.einsum("nqt,nte->nqe", probs_NQT, v_NTE)
    return out_NQE.reshape(B, K, G, S, E).transpose(0, 3, 1, 2, 4).reshape(B, S, H, E)

