"""The LM head split over the vocabulary under the batch axes (`chunked.py`'s loss and token
log-probabilities take it when the batch's tokens are at most the vocabulary, the mesh's only axes
of size > 1 split the batch and those divide the vocabulary).

Each device holds a vocabulary slice of the head weights (the parameters the model names as its
head, `Head.reads`, sliced along their "vocab" logical axis: tied [V, D], untied [D, V]) and gathers the hidden rows of the whole batch, fewer bytes than the weights
then; per chunk the slices' log-sum-exps and target logits are combined (one all-gather of
[2, rows, c] values); the weight gradient of a slice is complete on its device (no reduction), the
hidden state's gradient is summed over the slices and scattered back to its rows' devices
(`psum_scatter`). Element-wise heads (Gemma's soft-cap) work per slice. The token log-probabilities
(`vocab_split_log_probs`, RL) split the same way, with their own VJP.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from MaxText.losses.chunking import batch_axes, chunks, with_gradient_in_forward
from MaxText.losses.token_stats import logits_cotangent, sums_of_stats
from MaxText.models.model_def import Head
from MaxText.sharding.rules import current_context, logical_to_spec, without_rules


# The head split over the vocabulary under the batch axes (module docstring): used when the
# global batch's tokens are at most this many times the vocabulary, i.e. when gathering the hidden
# rows [tokens, D] moves no more than gathering the head weight [V, D] would (A/B:
# benchmarks/RESULTS.md, the CPU settings; 0 turns the split off).
VOCAB_SPLIT_MAX_TOKENS_PER_VOCAB = 1.0


@dataclasses.dataclass(frozen=True)
class _VocabSplit:
  axes: tuple[str, ...]           # the mesh axes that split the batch, and now the vocabulary
  used: tuple[bool, ...]          # per parameter leaf: read by the head
  vocab_dims: tuple[int, ...]     # per used leaf: its vocabulary dimension
  stored: tuple[P, ...]           # per used leaf: its own sharding (by its logical axes)


def vocab_split_plan(head: Head, params, logical_axes, hidden_BSD: jax.Array,
                     chunk: int) -> _VocabSplit | None:
  """How to split the head over the vocabulary, or None for the per-batch-shard loop: needs a
  mesh whose only axes of size > 1 split the batch, a head whose every weight has a "vocab"
  dimension (its `logical_axes`; tied [V, D] or untied [D, V]) of one size V divisible by those
  axes, and a batch of at most VOCAB_SPLIT_MAX_TOKENS_PER_VOCAB x V tokens."""
  ctx = current_context()
  if ctx is None or logical_axes is None:
    return None
  B, S = hidden_BSD.shape[:2]
  axes = batch_axes(ctx, B)
  n = math.prod(ctx.mesh.shape[a] for a in axes)
  if n == 1 or any(size > 1 and a not in axes for a, size in ctx.mesh.shape.items()):
    return None
  leaves = jax.tree.leaves(params)
  names = jax.tree.leaves(logical_axes, is_leaf=lambda x: isinstance(x, tuple))
  if len(names) != len(leaves):
    return None
  used = head.reads(params)   # the head's weights, by name (`Head.paths`)
  dims, sizes, stored = [], set(), []
  for leaf, axes_names, u in zip(leaves, names, used):
    if u:
      if "vocab" not in axes_names or len(axes_names) != leaf.ndim:
        return None
      dims.append(axes_names.index("vocab"))
      sizes.add(leaf.shape[dims[-1]])
      stored.append(logical_to_spec(axes_names, leaf.shape, ctx.rules, ctx.mesh))
  if len(sizes) != 1:
    return None
  V = sizes.pop()
  if V % n or B * S > VOCAB_SPLIT_MAX_TOKENS_PER_VOCAB * V:
    return None
  # the head must take a slice of its weights (e.g. a quantized head's packed kernel may not)
  it, sliced = iter(dims), []
  for x, u in zip(leaves, used):
    if u:
      d = next(it)
      x = jax.ShapeDtypeStruct(x.shape[:d] + (V // n,) + x.shape[d + 1:], x.dtype)
    sliced.append(x)
  try:
    out = jax.eval_shape(head, jax.tree.unflatten(jax.tree.structure(params), sliced),
                         hidden_BSD[:, :chunk])
  except (TypeError, ValueError):
    return None
  if out.shape[-1] != V // n:
    return None
  return _VocabSplit(axes, tuple(used), tuple(dims), tuple(stored))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _grad_sharded(x: jax.Array, shardings: tuple[NamedSharding, ...]) -> jax.Array:
  """x; its gradient constrained to each of `shardings` in turn (the last one stays)."""
  return x


def _constrain_in_turn(shardings, _, g):
  for sharding in shardings:
    g = jax.lax.with_sharding_constraint(g, sharding)
  return (g,)


_grad_sharded.defvjp(lambda x, shardings: (x, None), _constrain_in_turn)


def _mesh() -> Mesh:
  """The mesh of the sharding rules in use (a split `vocab_split_plan` planned runs under them)."""
  ctx = current_context()
  if ctx is None:
    raise ValueError("the vocabulary split runs under sharding rules (use_rules): none in use")
  return ctx.mesh


def _axes_of(entry) -> tuple[str, ...]:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _gradient_path(plan: _VocabSplit, stored: P, vocab_dim: int, ndim: int) -> tuple[P, ...]:
  """The shardings a weight's gradient goes through from its vocabulary slices (the vocabulary
  split over all of `plan.axes`) to its own sharding `stored`. Where the batch axes include axes
  that `stored` does not use (data under data x fsdp: the weight is replicated there), first the
  stored split of the other dimensions with the vocabulary still split over those axes (an
  all-to-all over the shared axes only), then `stored` (an all-gather over the others): XLA's
  partitioner cannot go from "V over data x fsdp" to "D over fsdp" in one step; it gathers the
  whole gradient on every device and slices it ("Involuntary full rematerialization")."""
  mesh = _mesh()
  used = {a for entry in stored for a in _axes_of(entry)}
  others = tuple(a for a in plan.axes if a not in used and mesh.shape[a] > 1)
  if not others:
    return (stored,)
  via = list(stored) + [None] * (ndim - len(stored))
  via[vocab_dim] = _axes_of(via[vocab_dim]) + others
  return P(*via), stored


def _split_weights(plan: _VocabSplit, head: Head, params):
  """(the head's weights, each with its gradient in its own sharding; the other leaves; the
  weights' in-specs as vocabulary slices; head_w(w, rest, hidden) -> the slice's logits)."""
  mesh = _mesh()
  leaves, treedef = jax.tree.flatten(params)
  # their gradients leave in the weights' own sharding (else XLA may move the optimizer's update
  # of the head, its moments included, to the vocabulary slices and back)
  w: list[jax.Array] = [
      _grad_sharded(x, tuple(NamedSharding(mesh, spec)
                             for spec in _gradient_path(plan, stored, d, x.ndim)))
      for x, stored, d in zip([x for x, u in zip(leaves, plan.used) if u], plan.stored,
                              plan.vocab_dims)]
  rest = [x for x, u in zip(leaves, plan.used) if not u]
  w_specs = [P(*(plan.axes if i == d else None for i in range(x.ndim))) for x, d in
             zip(w, plan.vocab_dims)]

  def head_w(w_, rest_, h_):
    it_w, it_rest = iter(w_), iter(rest_)
    return head(jax.tree.unflatten(treedef, [next(it_w) if u else next(it_rest)
                                             for u in plan.used]), h_)
  return w, rest, w_specs, head_w


def _slice_stats(logits, t_rel, axes, with_mean_logit: bool = False):
  """(log-sum-exp, target logit[, the softmax-weighted mean logit]) [B, c] over the whole
  vocabulary from this device's fp32 slice logits [B, c, V / n] (`t_rel`: the targets relative to
  the slice), its slice's values combined with the others' in one all-gather."""
  V_loc = logits.shape[-1]
  lse_loc = jax.nn.logsumexp(logits, axis=-1)
  inside = (t_rel >= 0) & (t_rel < V_loc)
  t_logit = jnp.take_along_axis(logits, jnp.clip(t_rel, 0, V_loc - 1)[..., None], axis=-1)
  local = [lse_loc, jnp.where(inside, t_logit[..., 0], 0.0)]
  if with_mean_logit:      # Σ softmax·logit over the slice, its softmax normalised by the slice
    local.append(jnp.sum(jnp.exp(logits - lse_loc[..., None]) * logits, axis=-1))
  parts = jax.lax.all_gather(jnp.stack(local), axes)          # [slices, 2 or 3, B, c]
  lse = jax.nn.logsumexp(parts[:, 0], axis=0)
  stats = (lse, jnp.sum(parts[:, 1], axis=0))
  if with_mean_logit:      # the slices' means weighted by their share of the probability
    stats += (jnp.sum(jnp.exp(parts[:, 0] - lse) * parts[:, 2], axis=0),)
  return stats


def _rows_grad_to_owners(dh_nBcD: jax.Array, S: int, axes, dtype) -> jax.Array:
  """The slices' partial gradients of every row's hidden state [n chunks, B, c, D]: summed over
  the slices and scattered back to the rows' devices [B / slices, S, D] (the sum in fp32)."""
  B, D = dh_nBcD.shape[1], dh_nBcD.shape[-1]
  dh_BSD = dh_nBcD.swapaxes(0, 1).reshape(B, -1, D)[:, :S]
  return jax.lax.psum_scatter(dh_BSD.astype(jnp.float32), axes, scatter_dimension=0,
                              tiled=True).astype(dtype)


def vocab_split_sums(plan: _VocabSplit, head: Head, params, hidden_BSD: jax.Array,
                     targets_BS: jax.Array, mask_BS: jax.Array, z_loss_weight: float,
                     chunk: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The chunked cross-entropy with each device holding a vocabulary slice of the head weights
  and the hidden rows of the whole batch (gathered over the batch axes): per chunk, each device's
  log-sum-exp and target logit over its slice are combined across the slices (one all-gather of
  [2, B, c] values); the slice's weight gradient is complete on its device (no reduction), the
  hidden state's gradient is summed over the slices and scattered back to the rows' devices."""
  axes = plan.axes
  w, rest, w_specs, head_w = _split_weights(plan, head, params)
  row_spec = P(axes)

  def local(w_, rest_, h_loc, t_loc, m_loc):
    me = jax.lax.axis_index(axes)
    B_loc, S = h_loc.shape[:2]
    t_all = jax.lax.all_gather(t_loc, axes, axis=0, tiled=True)        # [B, S]
    m_all = jax.lax.all_gather(m_loc, axes, axis=0, tiled=True).astype(jnp.float32)
    B = t_all.shape[0]
    own_B = (jnp.arange(B) // B_loc == me).astype(jnp.float32)         # the rows it reports
    V_loc = w_[0].shape[plan.vocab_dims[0]]
    xs = (chunks(t_all - me * V_loc, chunk), chunks(m_all, chunk))   # targets in the slice

    def sums_of(lse, t_logit, m):       # of the rows it reports
      return sums_of_stats(lse, t_logit, m * own_B[:, None], z_loss_weight)

    def sums_and_grads(wv, h_):
      h_all = jax.lax.all_gather(h_, axes, axis=0, tiled=True)         # [B, S, D]

      def one_chunk(dw, inp):
        h_BcD, t_rel, m = inp
        logits, pullback = jax.vjp(lambda ww, hh: head_w(ww, rest_, hh), wv, h_BcD)
        lse, t_logit = _slice_stats(logits.astype(jnp.float32), t_rel, axes)  # pyright: ignore[reportAssignmentType]
        dw_c, dh_BcD = pullback(logits_cotangent(logits, lse, t_rel, m, z_loss_weight)
                                .astype(logits.dtype))
        return jax.tree.map(jnp.add, dw, dw_c), (sums_of(lse, t_logit, m), dh_BcD)

      dw0 = jax.tree.map(jnp.zeros_like, wv)
      dw, (sums_n, dh_nBcD) = jax.lax.scan(one_chunk, dw0, (chunks(h_all, chunk), *xs))
      dh_loc = _rows_grad_to_owners(dh_nBcD, S, axes, h_.dtype)
      return jax.tree.map(lambda x: jax.lax.psum(jnp.sum(x), axes), sums_n), dw, dh_loc

    def sums_only(wv, h_):
      h_all = jax.lax.all_gather(h_, axes, axis=0, tiled=True)

      def one_chunk(_, inp):
        h_BcD, t_rel, m = inp
        lse, t_logit = _slice_stats(  # pyright: ignore[reportAssignmentType] (2 values by default)
            head_w(wv, rest_, h_BcD).astype(jnp.float32), t_rel, axes)
        return None, sums_of(lse, t_logit, m)
      _, sums_n = jax.lax.scan(one_chunk, None, (chunks(h_all, chunk), *xs))
      return jax.tree.map(lambda x: jax.lax.psum(jnp.sum(x), axes), sums_n)

    with without_rules():
      return with_gradient_in_forward(sums_only, sums_and_grads)(w_, h_loc)

  return jax.shard_map(local, mesh=_mesh(), axis_names=frozenset(axes),
                       in_specs=(w_specs, [P()] * len(rest), row_spec, row_spec, row_spec),
                       out_specs=P())(w, rest, hidden_BSD, targets_BS, mask_BS)



def vocab_split_log_probs(plan: _VocabSplit, head: Head, params, hidden_BSD: jax.Array,
                          targets_BS: jax.Array, chunk: int, entropy: bool):
  """`chunked_target_log_probs` with the head split over the vocabulary as in `vocab_split_sums`
  (each device: a vocabulary slice of the weights, the hidden rows of the whole batch; per chunk
  one all-gather of [2 or 3, B, c] slice statistics). Its VJP keeps each position's log-sum-exp
  (and softmax-weighted mean logit) from the forward pass, so the backward pass recomputes a
  chunk's slice logits without a collective: d logits = g_logp·(one-hot − p) − g_entropy·p·(logit
  − mean logit); the slices' gradients of the rows are summed and scattered back to the rows'
  devices (in fp32), the weights' slices need no reduction."""
  axes = plan.axes
  w, rest, w_specs, head_w = _split_weights(plan, head, params)
  row_spec = P(axes)

  def local(w_, rest_, h_loc, t_loc):
    me = jax.lax.axis_index(axes)
    B_loc, S = t_loc.shape
    t_all = jax.lax.all_gather(t_loc, axes, axis=0, tiled=True)        # [B, S]
    B, V_loc = t_all.shape[0], w_[0].shape[plan.vocab_dims[0]]
    t_rel_n = chunks(t_all - me * V_loc, chunk)                       # targets in the slice

    def own_rows(x_nBc):                  # [n, B, c] -> this device's rows [B_loc, S]
      x_BS = x_nBc.swapaxes(0, 1).reshape(B, -1)[:, :S]
      return jax.lax.dynamic_slice_in_dim(x_BS, me * B_loc, B_loc, axis=0)

    def forward(wv, h_):
      h_all = jax.lax.all_gather(h_, axes, axis=0, tiled=True)         # [B, S, D]

      def one_chunk(_, inp):
        h_BcD, t_rel = inp
        logits = head_w(wv, rest_, h_BcD).astype(jnp.float32)
        return None, _slice_stats(logits, t_rel, axes, with_mean_logit=entropy)
      _, stats_n = jax.lax.scan(one_chunk, None, (chunks(h_all, chunk), t_rel_n))
      return h_all, stats_n

    def outputs(stats_n):
      logp = own_rows(stats_n[1] - stats_n[0])
      return (logp, own_rows(stats_n[0] - stats_n[2])) if entropy else (logp,)

    @jax.custom_vjp
    def log_probs(wv, h_):
      return outputs(forward(wv, h_)[1])

    def log_probs_fwd(wv, h_):
      h_all, stats_n = forward(wv, h_)
      return outputs(stats_n), (wv, h_all, t_rel_n, stats_n)

    # the leaves the head does not read (not in `head.paths`), as zeros of their shapes: the backward
    # pass may hold no tracer of the forward one
    rest_shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in rest_]

    def log_probs_bwd(res, g):
      wv, h_all, t_rel_b, stats_n = res
      rest_b = [jnp.zeros(x.shape, x.dtype) for x in rest_shapes]
      # every row's cotangents: this slice's part of every row's logits gradient
      g_n = [chunks(jax.lax.all_gather(x, axes, axis=0, tiled=True), chunk) for x in g]

      def one_chunk(dw, inp):
        h_BcD, t_rel, lse, mean, g_lp, g_ent = inp
        logits, pullback = jax.vjp(lambda ww, hh: head_w(ww, rest_b, hh), wv, h_BcD)
        l32 = logits.astype(jnp.float32)
        p = jnp.exp(l32 - lse[..., None])
        dlogits = g_lp[..., None] * (jax.nn.one_hot(t_rel, V_loc, dtype=jnp.float32) - p)
        if entropy:
          dlogits = dlogits - g_ent[..., None] * p * (l32 - mean[..., None])
        dw_c, dh_BcD = pullback(dlogits.astype(logits.dtype))
        return jax.tree.map(jnp.add, dw, dw_c), dh_BcD

      zeros = jnp.zeros_like(stats_n[0])
      mean_n, g_ent_n = (stats_n[2], g_n[1]) if entropy else (zeros, zeros)
      with without_rules():      # traced when differentiated, after the forward's `with`
        dw, dh_nBcD = jax.lax.scan(
            one_chunk, jax.tree.map(jnp.zeros_like, wv),
            (chunks(h_all, chunk), t_rel_b, stats_n[0], mean_n, g_n[0], g_ent_n))
      return dw, _rows_grad_to_owners(dh_nBcD, S, axes, h_all.dtype)

    log_probs.defvjp(log_probs_fwd, log_probs_bwd)
    with without_rules():
      out = log_probs(w_, h_loc)
    return out if entropy else out[0]

  out_specs = (row_spec, row_spec) if entropy else row_spec
  return jax.shard_map(local, mesh=_mesh(), axis_names=frozenset(axes),
                       in_specs=(w_specs, [P()] * len(rest), row_spec, row_spec),
                       out_specs=out_specs)(w, rest, hidden_BSD, targets_BS)

