"""Mixture of experts: routing, dropless grouped-matmul experts, expert parallelism.

Conventions
  T tokens (batch x sequence, flattened), D model width, E experts, k experts per token, F expert
  hidden width, M token copies (T*k) or rows of a dispatch buffer, P shards of the `expert` mesh
  axis, X = E / P experts per shard.

Compute (dropless): each token's k copies are sorted by expert and run through two grouped matmuls
(`jax.lax.ragged_dot`: gate|up fused [E, D, 2F], then down [E, F, D]); outputs are unsorted and
summed with the routing weights. `capacity_factor > 0` instead keeps at most
ceil(capacity_factor * T*k / E) copies per expert (the rest contribute nothing; counted as dropped).

Expert parallelism (`expert` mesh axis > 1): inside `jax.shard_map`, each device sorts its own
token copies, sends each shard the rows for its experts with a ragged all-to-all, runs its local
experts and sends results back the same way. `jax.lax.ragged_all_to_all` is used on GPU/TPU; on
XLA:CPU (which does not implement it) `padded_ragged_all_to_all` gives identical results with a
dense `all_to_all` of buffers padded to the largest possible slice. The receive buffer holds the
worst case (P x local copies), so nothing is ever dropped.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from MaxText.layers.linear import DenseGeneral, LayerKw, param
from MaxText.layers.mlp import ACTIVATIONS, GatedMLP
from MaxText.metrics import moe_load
from MaxText.sharding.rules import current_context, logical_to_spec


# ---- routing ----------------------------------------------------------------------------------
def route(logits_TE: jax.Array, k: int, *, renormalize: bool, bias_E: jax.Array | None = None
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """softmax (fp32) → top-k (on probs + bias: the bias steers selection only) → optional
  renormalisation. Returns (weights [T,k] fp32, experts [T,k] int32, probs [T,E] fp32)."""
  probs_TE = jax.nn.softmax(logits_TE.astype(jnp.float32), axis=-1)
  scores_TE = probs_TE if bias_E is None else probs_TE + bias_E.astype(jnp.float32)
  _, experts_Tk = jax.lax.top_k(scores_TE, k)
  weights_Tk = jnp.take_along_axis(probs_TE, experts_Tk, axis=-1)
  if renormalize:
    weights_Tk = weights_Tk / jnp.sum(weights_Tk, axis=-1, keepdims=True)
  return weights_Tk, experts_Tk.astype(jnp.int32), probs_TE


def load_balancing_terms(probs_TE, experts_Tk, mask_T) -> tuple[jax.Array, jax.Array]:
  """Per-expert sums over the (unmasked) tokens: copies routed to it [E] and router probability
  [E] — the two factors of the Switch/Qwen auxiliary loss (see `aux_loss`)."""
  E = probs_TE.shape[-1]
  m = mask_T.astype(jnp.float32)
  counts_E = jnp.sum(jax.nn.one_hot(experts_Tk, E, dtype=jnp.float32) * m[:, None, None], (0, 1))
  return counts_E, jnp.sum(probs_TE * m[:, None], axis=0)


def aux_loss(counts_LE, probs_LE, tokens) -> jax.Array:
  """Hugging Face's load-balancing loss over all MoE layers' routing at once:
  E * sum_e (copies_e / (L*T)) * (prob_e / (L*T)), with T the (unmasked) tokens per layer."""
  L, E = counts_LE.shape
  n = jnp.maximum(L * tokens, 1.0)
  return E * jnp.sum(jnp.sum(counts_LE, 0) / n * jnp.sum(probs_LE, 0) / n)


def empty_stats(num_layers: int, num_experts: int) -> dict:
  """Per-layer routing statistics that travel through the layer stack (see `record`)."""
  return {"counts": jnp.zeros((num_layers, num_experts), jnp.float32),
          "probs": jnp.zeros((num_layers, num_experts), jnp.float32),
          "dropped": jnp.zeros((), jnp.int32)}


def record(stats: dict, layer, counts_E, probs_E, dropped) -> dict:
  return {"counts": stats["counts"].at[layer].set(counts_E),
          "probs": stats["probs"].at[layer].set(probs_E),
          "dropped": stats["dropped"] + dropped}


def stack_inputs(moe_layers: tuple[int, ...], num_layers: int, bias_ME: jax.Array
                 ) -> tuple[dict, dict]:
  """What a pattern stack of `num_layers` layers carries and hands its MoE layers (`moe_layers`,
  in order): empty routing statistics, and per layer {"moe_layer": its row of the statistics
  (dense layers: row 0, never read), "bias": its selection bias [E] (rows of `bias_ME`)}."""
  row_L = np.zeros(num_layers, np.int32)
  row_L[list(moe_layers)] = np.arange(len(moe_layers))
  return (empty_stats(len(moe_layers), bias_ME.shape[-1]),
          {"moe_layer": jnp.asarray(row_L), "bias": bias_ME[row_L]})


def finished_stats(stats: dict, segment_ids_BS) -> dict:
  """What a model returns as `moe_stats`: the statistics plus the unmasked token count."""
  return {**stats, "tokens": jnp.sum(segment_ids_BS != 0).astype(jnp.float32)}


def moe_metrics(load_LE: jax.Array, aux_loss_mean: jax.Array, dropped: jax.Array,
                layers: tuple[int, ...]) -> dict:
  """Expert load per MoE layer as max/mean (1.0 = perfectly even; named by the layer's index in
  the model), its worst layer, the aux loss and the token copies dropped (0 when dropless)."""
  ratio_L = jnp.max(load_LE, axis=1) / jnp.maximum(jnp.mean(load_LE, axis=1), 1e-9)
  out = {"moe_aux_loss": aux_loss_mean, "moe_dropped": dropped.astype(jnp.float32),
         moe_load.KEY: jnp.max(ratio_L)}
  out.update({f"{moe_load.KEY}/layer_{i}": ratio_L[j] for j, i in enumerate(layers)})
  return out


def update_router_bias(bias_LE: jax.Array, load_LE: jax.Array, rate: float) -> jax.Array:
  """Aux-loss-free balancing (DeepSeek-V3): raise the selection bias of under-loaded experts and
  lower it for over-loaded ones by `rate`, outside the gradient."""
  mean_L1 = jnp.mean(load_LE, axis=1, keepdims=True)
  return bias_LE + (rate * jnp.sign(mean_L1 - load_LE)).astype(bias_LE.dtype)


@dataclass(frozen=True)
class MoETerms:
  """The training terms of routed experts (a family's `aux_terms`, MaxText/models/family.py):
  from `aux["moe_stats"]` ([MoE layers, E] statistics and the token count) the load-balancing
  loss (`aux_loss` x `aux_loss_weight`, summed over tokens like the cross-entropy), the load
  metrics, and after each step the aux-loss-free update of the selection bias (the parameter
  `bias_name`, [MoE layers, E]) by `bias_update_rate`, outside the gradient. `layers`: the model's
  index of each MoE layer (metric names). On the host, `watch()` shows the expert load on the
  progress line and warns when it collapses (`metrics/moe_load.py`)."""
  aux_loss_weight: float
  bias_update_rate: float
  layers: tuple[int, ...]
  num_experts: int
  experts_per_token: int
  bias_name: str = "router_bias"

  def loss(self, aux: dict) -> tuple[jax.Array, dict]:
    st = aux["moe_stats"]
    aux_sum = aux_loss(st["counts"], st["probs"], st["tokens"]) * st["tokens"]
    return self.aux_loss_weight * aux_sum, {"aux_loss_sum": aux_sum, "load": st["counts"],
                                            "dropped": st["dropped"]}

  def update(self, params: dict, sums: dict) -> dict:
    if self.bias_update_rate <= 0:
      return params
    return {**params, self.bias_name: update_router_bias(params[self.bias_name], sums["load"],
                                                         self.bias_update_rate)}

  def metrics(self, sums: dict, tokens: jax.Array) -> dict:
    return moe_metrics(sums["load"], sums["aux_loss_sum"] / tokens, sums["dropped"], self.layers)

  def watch(self) -> moe_load.CollapseWatch:
    return moe_load.CollapseWatch(
        self.num_experts, self.experts_per_token,
        balancing=f"moe_aux_loss_weight={self.aux_loss_weight:g}, "
                  f"router_bias_update_rate={self.bias_update_rate:g}",
        advice="Raise moe_aux_loss_weight (Hugging Face's router_aux_loss_coef, e.g. 0.001-0.01) "
               "or set router_bias_update_rate (e.g. 0.001)")


def active_matmul_params(emb_dim: int, num_experts: int, k: int, mlp_dim: int,
                         shared_mlp_dim: int = 0) -> int:
  """Weights a token meets in one routed MLP (FLOPs): the router, its k experts' gate, up and
  down, and the shared expert with its gate when there is one."""
  D = emb_dim
  shared = 3 * D * shared_mlp_dim + D if shared_mlp_dim else 0
  return D * num_experts + k * 3 * D * mlp_dim + shared


# ---- ragged all-to-all ------------------------------------------------------------------------
def padded_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                             recv_sizes, *, axis_name):
  """`jax.lax.ragged_all_to_all`'s semantics from a dense `all_to_all`: the slice for peer p
  (operand[input_offsets[p] : +send_sizes[p]]) travels in a buffer padded to operand's length and
  is written at output_offsets[p] (an offset in the receiver's output); `output` keeps its values
  elsewhere. `recv_sizes[p]` is what arrives from peer p."""
  C = operand.shape[0]
  rows = jnp.arange(C)
  take = jnp.clip(input_offsets[:, None] + rows[None], 0, C - 1)            # [P, C]
  valid = rows[None] < send_sizes[:, None]
  buf = jnp.where(valid.reshape(*valid.shape, *(1,) * (operand.ndim - 1)), operand[take], 0)
  recv = jax.lax.all_to_all(buf, axis_name, 0, 0, tiled=True)               # [P(src), C, ...]
  where = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)   # offsets in my output
  dest = jnp.where(rows[None] < recv_sizes[:, None], where[:, None] + rows[None], output.shape[0])
  return output.at[dest.reshape(-1)].set(recv.reshape(-1, *operand.shape[1:]), mode="drop")


RAGGED_ALL_TO_ALL = {"ragged_all_to_all": jax.lax.ragged_all_to_all,
                     "padded_all_to_all": padded_ragged_all_to_all}


def select_dispatch(name: str, platform: str) -> str:
  """`auto` → the real ragged all-to-all on GPU/TPU, the padded emulation on CPU."""
  if name != "auto":
    return name
  return "padded_all_to_all" if platform == "cpu" else "ragged_all_to_all"


# ---- experts ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class FloatExperts:
  """How `RoutedExperts` multiplies by its experts: the weights it hands the grouped matmul
  (`operands`: pytrees whose every leaf has the expert axis first, so they split over `expert`)
  and the grouped matmul itself. This one: the float weights and `jax.lax.ragged_dot`; quantized
  forms (layers/quant.py) replace both."""

  def operands(self, experts: "RoutedExperts", dtype) -> tuple:
    return experts.wi[...].astype(dtype), experts.wo[...].astype(dtype)

  matmul: str = field(default="ragged_dot", kw_only=True)    # or "megablox" (`select_matmul`)
  tiles: tuple[int, ...] = field(default=(512, 1024, 1024), kw_only=True)  # megablox's tiles

  def ragged_dot(self, rows_MK: jax.Array, w, sizes_X: jax.Array) -> jax.Array:
    if self.matmul == "megablox":
      return megablox_dot(rows_MK, w, sizes_X, self.tiles)
    return jax.lax.ragged_dot(rows_MK, w, sizes_X)


def select_matmul(name: str) -> str:
  """`moe_matmul`: auto → ragged_dot (XLA's; benchmarks/RESULTS.md, "TPU v5e", has megablox beside
  it on the chip)."""
  return "ragged_dot" if name == "auto" else name


def megablox_dot(rows_MK: jax.Array, w_XKN: jax.Array, sizes_X: jax.Array,
                 tiles: Sequence[int] = (512, 1024, 1024)) -> jax.Array:
  """`jax.lax.ragged_dot` by JAX's Pallas TPU grouped matmul (megablox `gmm`, with its own VJP:
  `gmm` for the rows' gradient, `tgmm` for the weights'); interpreted off TPU. Rows past the
  groups' total give zeros, as ragged_dot's do (the kernel leaves them unwritten), and take a zero
  gradient. Tiles: each clipped to its dimension rounded up to 128, the rows' tile to one that
  divides the rows (the kernel's grid)."""
  from jax.experimental.pallas.ops.tpu.megablox import ops as megablox  # pylint: disable=import-outside-toplevel
  M, K = rows_MK.shape
  N = w_XKN.shape[2]
  up = lambda n: -(-n // 128) * 128
  tm = math.gcd(M, min(tiles[0], up(M)))
  tiling = (tm, min(tiles[1], up(K)), min(tiles[2], up(N)))
  valid_M = jnp.arange(M) < jnp.sum(sizes_X)
  rows_MK = jnp.where(valid_M[:, None], rows_MK, jnp.zeros((), rows_MK.dtype))
  out = megablox.gmm(rows_MK, w_XKN, sizes_X.astype(jnp.int32), rows_MK.dtype, tiling, None, None,
                     False, jax.default_backend() != "tpu")
  return jnp.where(valid_M[:, None], out, jnp.zeros((), out.dtype))


def grouped_ffn(rows_MD, wi_XDF2, wo_XFD, sizes_X, act: Callable,
                dot: Callable = jax.lax.ragged_dot) -> jax.Array:
  """Rows sorted by expert (sizes_X of them per expert; rows past the total give zeros). `dot`:
  the grouped matmul of the experts' weights (`FloatExperts.ragged_dot` or a quantized one)."""
  h_MF2 = dot(rows_MD, wi_XDF2, sizes_X)
  gate_MF, up_MF = jnp.split(h_MF2, 2, axis=-1)
  return dot(act(gate_MF) * up_MF, wo_XFD, sizes_X)


def _sort_copies(experts_Tk, num_experts: int, capacity: int | None):
  """Token copies grouped by expert: (order [M], copies per expert [E], keep [M] in sorted order)."""
  flat_M = experts_Tk.reshape(-1)
  order_M = jnp.argsort(flat_M, stable=True)
  sizes_E = jnp.bincount(flat_M, length=num_experts).astype(jnp.int32)
  if capacity is None:
    return order_M, sizes_E, None
  starts_E = jnp.cumsum(sizes_E) - sizes_E
  sorted_e = flat_M[order_M]
  keep_M = jnp.arange(flat_M.shape[0]) - starts_E[sorted_e] < capacity
  return order_M, sizes_E, keep_M


def inverse_permutation(order_M: jax.Array) -> jax.Array:
  """inv with inv[order[m]] = m (an integer scatter of M indices: cheap beside the rows)."""
  M = order_M.shape[0]
  return jnp.zeros((M,), order_M.dtype).at[order_M].set(jnp.arange(M, dtype=order_M.dtype))


# The token copies move between token order and expert order by gathers only, both ways: a
# gather's autodiff transpose is a scatter-add, and XLA:TPU's scatters of 16-bit rows (emulated on
# 32-bit words, read-modify-write) cost ~3x a gather of the same rows (one v5e, Qwen3-30B-A3B
# widths: 21 ms of a 270 ms step per pass of the 4 layers). The transposes below are the gathers
# by the inverse permutation.
@jax.custom_vjp
def _dispatch_rows(x_TD, order_M, inv_M):
  """rows[m] = x[order[m] // k]: each token's k copies in expert order (k = M / T)."""
  return x_TD[order_M // (order_M.shape[0] // x_TD.shape[0])]


def _dispatch_fwd(x_TD, order_M, inv_M):
  # (an empty [T, 0] array carries x's row count and dtype: residuals must be arrays)
  T = x_TD.shape[0]
  return (_dispatch_rows(x_TD, order_M, inv_M),
          (copy_major(inv_M, T), jnp.zeros((T, 0), x_TD.dtype)))


def _dispatch_bwd(res, g_MD):
  """dx[t] = Σ_j g[inv[t·k + j]]: the copies gathered back copy-major ([k, T, D]: k is not the
  padded second-minor axis), summed in fp32."""
  inv_cm, like_T0 = res
  g_kTD = g_MD[inv_cm].reshape(-1, like_T0.shape[0], g_MD.shape[-1])
  return jnp.sum(g_kTD.astype(jnp.float32), axis=0).astype(like_T0.dtype), None, None


def copy_major(inv_M: jax.Array, T: int) -> jax.Array:
  """inv (sorted position of copy t·k + j) laid out copy-major: entry j·T + t. Arrays of a
  token's k copies are then [k, T, D], not [T, k, D]: on a TPU the second-minor axis is tiled by
  8 or 16 rows, so k = 8 or 10 there doubles or pads the array (Qwen3-Next's top-10: 512 MiB where
  320 suffice, at the step's peak; compiled for a v5e by benchmarks/tpu_aot.py)."""
  return inv_M.reshape(T, -1).T.reshape(-1)


_dispatch_rows.defvjp(_dispatch_fwd, _dispatch_bwd)


@jax.custom_vjp
def permute_rows(x_MD, perm_M, inverse_M):
  """x[perm] for a permutation `perm` (`inverse` = inverse_permutation(perm)): its transpose is
  the gather g[inverse], not a scatter-add."""
  return x_MD[perm_M]


def _permute_fwd(x_MD, perm_M, inverse_M):
  return permute_rows(x_MD, perm_M, inverse_M), inverse_M


def _permute_bwd(inverse_M, g_MD):
  return g_MD[inverse_M], None, None


permute_rows.defvjp(_permute_fwd, _permute_bwd)


def _combine(out_MD, order_M, inv_M, weights_Tk):
  """The expert-ordered rows back in token-copy order (copies[c] = out[inv[c]], laid out
  copy-major: `copy_major`), each token's k copies summed with its routing weights."""
  T, k = weights_Tk.shape
  order_cm = (order_M % k) * T + order_M // k        # copy t·k + j's copy-major index j·T + t
  copies_kTD = permute_rows(out_MD, copy_major(inv_M, T), order_cm).reshape(k, T, -1)
  return jnp.einsum("ktd,tk->td", copies_kTD, weights_Tk.astype(out_MD.dtype))


def experts_local(x_TD, weights_Tk, experts_Tk, wi, wo, act, capacity: int | None,
                  dot: Callable = jax.lax.ragged_dot):
  """All experts on this device. Returns (y [T,D], dropped copies)."""
  T, k = experts_Tk.shape
  order_M, sizes_E, keep_M = _sort_copies(experts_Tk, jax.tree.leaves(wi)[0].shape[0], capacity)
  inv_M = inverse_permutation(order_M)
  rows_MD = _dispatch_rows(x_TD, order_M, inv_M)
  out_MD = grouped_ffn(rows_MD, wi, wo, sizes_E, act, dot)
  dropped = jnp.zeros((), jnp.int32)
  if keep_M is not None:
    out_MD = jnp.where(keep_M[:, None], out_MD, 0)
    dropped = jnp.sum(~keep_M).astype(jnp.int32)
  return _combine(out_MD, order_M, inv_M, weights_Tk), dropped


def experts_parallel(x_TD, weights_Tk, experts_Tk, wi_local, wo_local, act, *, num_experts: int,
                     axis: str, a2a: Callable, dot: Callable = jax.lax.ragged_dot):
  """Inside shard_map: this device's tokens, its X = E/P experts, a ragged all-to-all over `axis`."""
  T, k = experts_Tk.shape
  Pn = jax.lax.axis_size(axis)
  me = jax.lax.axis_index(axis)
  X = num_experts // Pn
  order_M, sizes_E, _ = _sort_copies(experts_Tk, num_experts, None)
  inv_M = inverse_permutation(order_M)
  rows_MD = _dispatch_rows(x_TD, order_M, inv_M)
  sizes_PX = sizes_E.reshape(Pn, X)
  send_P = jnp.sum(sizes_PX, axis=1)
  send_off_P = jnp.cumsum(send_P) - send_P
  all_SPX = jax.lax.all_gather(sizes_PX, axis)                    # [source, dest, local expert]
  to_me_SX = all_SPX[:, me]                                        # what each source sends me
  recv_S = jnp.sum(to_me_SX, axis=1)
  recv_off_S = jnp.cumsum(recv_S) - recv_S
  # where my slice lands in each receiver's buffer: after the slices of lower-numbered sources
  per_dest_SP = jnp.sum(all_SPX, axis=2)
  out_off_P = jnp.sum(jnp.where(jnp.arange(Pn)[:, None] < me, per_dest_SP, 0), axis=0)
  M = rows_MD.shape[0]
  buf_D = jnp.zeros((Pn * M, rows_MD.shape[1]), rows_MD.dtype)
  got_RD = a2a(rows_MD, buf_D, send_off_P, send_P, out_off_P, recv_S, axis_name=axis)
  # received rows come per source, each sorted by local expert: regroup them by local expert
  bounds = jnp.cumsum(to_me_SX.reshape(-1))                        # ends of (source, expert) runs
  run_R = jnp.searchsorted(bounds, jnp.arange(Pn * M), side="right")
  expert_R = jnp.where(run_R < Pn * X, run_R % X, X)               # X: padding rows, sorted last
  local_order_R = jnp.argsort(expert_R, stable=True)
  local_inv_R = inverse_permutation(local_order_R)
  out_RD = grouped_ffn(permute_rows(got_RD, local_order_R, local_inv_R), wi_local, wo_local,
                       jnp.sum(to_me_SX, 0), act, dot)
  back_RD = permute_rows(out_RD, local_inv_R, local_order_R)
  # return trip: each source's rows go back to where they were sent from
  their_off_S = jnp.sum(jnp.where(jnp.arange(Pn)[None, :] < me, jnp.sum(all_SPX, 2), 0), axis=1)
  mine_MD = a2a(back_RD, jnp.zeros_like(rows_MD), recv_off_S, recv_S, their_off_S, send_P,
                axis_name=axis)
  return _combine(mine_MD, order_M, inv_M, weights_Tk)


class RoutedExperts(nnx.Module):
  """E gated-MLP experts: wi [E, D, 2F] (gate | up), wo [E, F, D]. `quant` (layers/quant.py sets
  it; default `FloatExperts`) gives the grouped matmul's weights and the matmul."""

  def __init__(self, num_experts: int, emb_dim: int, mlp_dim: int, activation: Callable, *,
               rngs: nnx.Rngs, dtype, param_dtype, capacity_factor: float = 0.0,
               dispatch: str = "auto", matmul: str = "auto",
               tiles: tuple[int, ...] = (512, 1024, 1024)):
    E, D, F = num_experts, emb_dim, mlp_dim
    self.wi = param(rngs, (E, D, 2 * F), ("exp", "embed", "mlp"), std=D ** -0.5, dtype=param_dtype)
    self.wo = param(rngs, (E, F, D), ("exp", "mlp", "embed"), std=F ** -0.5, dtype=param_dtype)
    self.act = activation
    self.dtype = dtype
    self.capacity_factor = capacity_factor
    self.dispatch = select_dispatch(dispatch, jax.default_backend())
    self.quant = FloatExperts(matmul=select_matmul(matmul), tiles=tuple(tiles))

  def __call__(self, x_BSD, weights_BSk, experts_BSk) -> tuple[jax.Array, jax.Array]:
    """Returns (y [B,S,D], dropped token copies)."""
    B, S, D = x_BSD.shape
    k = experts_BSk.shape[-1]
    wi, wo = self.quant.operands(self, self.dtype)
    dot = self.quant.ragged_dot
    x_BSD = x_BSD.astype(self.dtype)
    E = jax.tree.leaves(wi)[0].shape[0]
    capacity = None
    if self.capacity_factor > 0:
      capacity = max(1, math.ceil(self.capacity_factor * B * S * k / E))
    ctx = current_context()
    if ctx is None:
      y, dropped = experts_local(x_BSD.reshape(B * S, D), weights_BSk.reshape(B * S, k),
                                 experts_BSk.reshape(B * S, k), wi, wo, self.act, capacity, dot)
      return y.reshape(B, S, D), dropped
    mesh = ctx.mesh
    spec = lambda names, shape: logical_to_spec(names, shape, ctx.rules, mesh)
    tok = spec(("activation_batch", "activation_length", None), (B, S, D))
    tok_k = P(tok[0], tok[1], None)
    ep = mesh.shape.get("expert", 1)
    if ep > 1 and E % ep:
      raise ValueError(f"num_experts={E} does not divide over the expert mesh axis ({ep})")
    w_spec = P("expert" if ep > 1 else None, None, None)
    if capacity is not None and ep > 1:
      raise ValueError("capacity_factor > 0 is a single-shard comparison mode; use it without "
                       "expert parallelism")
    a2a = RAGGED_ALL_TO_ALL[self.dispatch]

    def run(x, w, e, wi_l, wo_l):
      b, s = x.shape[:2]
      args = (x.reshape(b * s, D), w.reshape(b * s, k), e.reshape(b * s, k), wi_l, wo_l, self.act)
      if ep > 1:
        y = experts_parallel(*args, num_experts=E, axis="expert", a2a=a2a, dot=dot)
        dropped = jnp.zeros((), jnp.int32)
      else:
        local_cap = None if capacity is None else max(1, math.ceil(
            self.capacity_factor * b * s * k / E))
        y, dropped = experts_local(*args, local_cap, dot)
      return y.reshape(b, s, D), jax.lax.psum(dropped, tuple(mesh.axis_names))

    return jax.shard_map(run, mesh=mesh, in_specs=(tok, tok_k, tok_k, w_spec, w_spec),
                         out_specs=(tok, P()), check_vma=False)(
        x_BSD, weights_BSk, experts_BSk, wi, wo)


class RoutedMLP(nnx.Module):
  """The Qwen-style MoE MLP: a linear router on x (softmax → top-k → optional renormalisation,
  weights cast to the activation dtype), routed experts, and an optional shared expert gated by
  sigmoid(x · w_gate) (Qwen3-Next)."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    kw = LayerKw(rngs=rngs, dtype=cfg.compute_dtype, param_dtype=cfg.param_dtype)
    D, E = cfg.emb_dim, cfg.num_experts
    self.router = DenseGeneral((D,), (E,), ("embed", None), **kw)
    self.experts = RoutedExperts(E, D, cfg.moe_mlp_dim, ACTIVATIONS[cfg.mlp_activation],
                                 capacity_factor=cfg.capacity_factor, dispatch=cfg.moe_dispatch,
                                 matmul=cfg.moe_matmul, tiles=tuple(cfg.moe_matmul_tiles),
                                 **kw)
    self.k, self.renormalize, self.dtype = cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.compute_dtype
    if cfg.shared_expert_mlp_dim:
      self.shared = GatedMLP(D, cfg.shared_expert_mlp_dim, cfg.mlp_activation, **kw)
      self.shared_gate = DenseGeneral((D,), (1,), ("embed", None), **kw)
    else:
      self.shared = self.shared_gate = None

  def __call__(self, x_BSD, mask_BS, bias_E=None):
    """Returns (y [B,S,D], (copies per expert [E], router probability per expert [E], dropped))."""
    B, S, D = x_BSD.shape
    logits_BSE = self.router(x_BSD)
    w_Tk, e_Tk, probs_TE = route(logits_BSE.reshape(B * S, -1), self.k,
                                 renormalize=self.renormalize, bias_E=bias_E)
    w_BSk = w_Tk.astype(self.dtype).reshape(B, S, self.k)
    y_BSD, dropped = self.experts(x_BSD, w_BSk, e_Tk.reshape(B, S, self.k))
    if self.shared is not None and self.shared_gate is not None:   # (set together)
      y_BSD = y_BSD + self.shared(x_BSD) * jax.nn.sigmoid(self.shared_gate(x_BSD))
    counts_E, prob_sums_E = load_balancing_terms(probs_TE, e_Tk, mask_BS.reshape(-1))
    return y_BSD, (counts_E, prob_sums_E, dropped)
