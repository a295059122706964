"""The token loss of a micro-batch: masked cross-entropy (+ z-loss), whole or chunked.

Chunked (`loss_chunk_length` = c > 0, shorter than the sequence): the model returns its final-norm
hidden state [B, S, D] (`ModelDef.apply_hidden`) and the loss applies its LM head
(`ModelDef.head`) to c positions at a time: the sequence is cut into ceil(S / c) chunks and a
`lax.scan` runs head + cross-entropy on one [B, c, D] chunk at a time, so only one chunk's fp32
logits [B, c, V] exist at once instead of [B, S, V]. The loss's gradient is computed in the same
pass (a custom VJP): per chunk, the logits' gradient (softmax − one-hot, with the z-loss term)
goes straight through the head's own VJP, the head's parameter gradient is summed over the chunks
and the hidden state's gradient kept; the backward pass only scales both by the incoming
cotangent. So the head's three matmuls run once each, on chunks small enough to stay in cache
(measured on XLA:CPU: the [2048, 256] x [256, 8192] head's forward with the log-sum-exp 1.8x
cheaper in 8 chunks than whole, its fp32 logits no longer written to and read from memory).
Positions past S (padding of the last chunk) have mask 0. Only the loss sum carries a gradient:
the z-loss sum and the token count are metrics (stop_gradient).

Under a mesh the chunk loop runs inside a `shard_map` over the axes that split the batch, in one
of two ways:
- split over the vocabulary (when the batch's tokens are at most the vocabulary, the mesh's
  only axes of size > 1 split the batch and those divide the vocabulary): each device holds a
  vocabulary slice of the head weights (found by their "vocab" logical axis: tied [V, D], untied
  [D, V]) and gathers the hidden rows of the whole batch, fewer bytes than the weights then; per
  chunk the slices' log-sum-exps and target logits are combined (one all-gather of [2, rows, c]
  values); the weight gradient of a slice is complete on its device (no reduction), the hidden
  state's gradient is summed over the slices and scattered back to its rows' devices
  (`psum_scatter`). Element-wise heads (Gemma's soft-cap) work per slice. The token
  log-probabilities (`chunked_target_log_probs`, RL) split the same way, with their own VJP.
- else per batch shard: each device loops over its own rows; the head weights are gathered once
  before the loop and their gradient reduced once after it (a scan over globally sharded chunks
  would gather the head and reduce its gradient once per chunk). Axes that do not split the batch
  (tensor: the vocabulary) stay automatic.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from MaxText.sharding.rules import current_context, logical_to_spec, without_rules
from MaxText.models.model_def import ModelDef

HeadFn = Callable[[Any, jax.Array], jax.Array]   # (params, hidden [..., D]) -> fp32 logits [..., V]


def _lse_and_target_logit(logits_BSV: jax.Array, targets_BS: jax.Array):
  logits_BSV = logits_BSV.astype(jnp.float32)
  lse_BS = jax.nn.logsumexp(logits_BSV, axis=-1)
  target_logit_BS = jnp.take_along_axis(logits_BSV, targets_BS[..., None], axis=-1)[..., 0]
  return lse_BS, target_logit_BS


def target_log_probs(logits_BSV: jax.Array, targets_BS: jax.Array) -> jax.Array:
  """log p(target) [B, S] in fp32."""
  lse_BS, target_logit_BS = _lse_and_target_logit(logits_BSV, targets_BS)
  return target_logit_BS - lse_BS


def target_log_probs_and_entropy(logits_BSV: jax.Array, targets_BS: jax.Array
                                 ) -> tuple[jax.Array, jax.Array]:
  """(log p(target) [B, S], the entropy of the distribution at each position [B, S]), fp32."""
  logits_BSV = logits_BSV.astype(jnp.float32)
  lse_BS, target_logit_BS = _lse_and_target_logit(logits_BSV, targets_BS)
  probs_BSV = jnp.exp(logits_BSV - lse_BS[..., None])
  return target_logit_BS - lse_BS, lse_BS - jnp.sum(probs_BSV * logits_BSV, axis=-1)


def cross_entropy_sums(logits_BSV: jax.Array, targets_BS: jax.Array, mask_BS: jax.Array,
                       z_loss_weight: float) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Sums over unmasked tokens of (cross-entropy + z-loss), of the z-loss alone, and the count.
  Padding and targets across a packed-document boundary have mask 0."""
  return _sums_of_stats(*_lse_and_target_logit(logits_BSV, targets_BS), mask_BS, z_loss_weight)


def _sums_of_stats(lse_BS: jax.Array, target_logit_BS: jax.Array, mask_BS: jax.Array,
                   z_loss_weight: float) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`cross_entropy_sums` from each position's log-sum-exp and target logit (however they were
  computed: whole, or combined across vocabulary slices)."""
  mask = mask_BS.astype(jnp.float32)
  z_BS = z_loss_weight * jnp.square(lse_BS)
  nll = jnp.sum((lse_BS - target_logit_BS + z_BS) * mask)
  return nll, jnp.sum(z_BS * mask), jnp.sum(mask)


def _chunks(x_BS_: jax.Array, chunk: int) -> jax.Array:
  """[B, S, ...] → [n, B, chunk, ...], zero-padded to n·chunk positions."""
  B, S = x_BS_.shape[:2]
  n = -(-S // chunk)
  pad = [(0, 0), (0, n * chunk - S)] + [(0, 0)] * (x_BS_.ndim - 2)
  x = jnp.pad(x_BS_, pad)
  return x.reshape(B, n, chunk, *x_BS_.shape[2:]).swapaxes(0, 1)


def _batch_axes(ctx, rows: int) -> tuple[str, ...]:
  """The mesh axes that split a batch of `rows` rows ("activation_batch"), as a tuple."""
  axes = logical_to_spec(("activation_batch",), (rows,), ctx.rules, ctx.mesh)[0]
  return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def _per_batch_shard(fn: Callable, params, *batch_arrays: jax.Array):
  """fn(params, *batch_arrays) run per shard of the batch axes under a mesh (`use_rules`); its
  outputs are sums, added over the shards. Without a mesh: fn itself."""
  ctx = current_context()
  if ctx is None:
    return fn(params, *batch_arrays)
  axes = _batch_axes(ctx, batch_arrays[0].shape[0])
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


def _used_leaves(head: HeadFn, params, hidden_BcD: jax.Array) -> list[bool]:
  """Which leaves of `params` the head reads (its weights: the gradient is taken for those only,
  not accumulated as zeros for the whole model)."""
  leaves, treedef = jax.tree.flatten(params)
  jaxpr = jax.make_jaxpr(lambda ls, h: head(jax.tree.unflatten(treedef, ls), h))(
      leaves, hidden_BcD).jaxpr
  read = {id(v) for eqn in jaxpr.eqns for v in eqn.invars}
  read |= {id(v) for v in jaxpr.outvars}
  return [id(v) in read for v in jaxpr.invars[:len(leaves)]]


def _logits_cotangent(logits, lse, targets, mask, z_loss_weight):
  """d(Σ mask · (lse − logit[target] + z·lse²)) / d logits, in fp32: mask · ((1 + 2z·lse) ·
  softmax − one-hot), from the logits and their log-sum-exp `lse` over the whole vocabulary (the
  logits may be a vocabulary slice, `targets` relative to it: out of range has no one-hot)."""
  logits = logits.astype(jnp.float32)
  softmax = jnp.exp(logits - lse[..., None])
  scale = (mask.astype(jnp.float32) * (1.0 + 2.0 * z_loss_weight * lse))[..., None]
  onehot = jax.nn.one_hot(targets, logits.shape[-1], dtype=jnp.float32)
  return scale * softmax - mask.astype(jnp.float32)[..., None] * onehot


def _with_gradient_in_forward(sums_only: Callable, sums_and_grads: Callable) -> Callable:
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


def chunked_cross_entropy_sums(head: HeadFn, params, hidden_BSD: jax.Array,
                               targets_BS: jax.Array, mask_BS: jax.Array, z_loss_weight: float,
                               chunk: int, logical_axes=None
                               ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`cross_entropy_sums(head(params, hidden), …)` without materialising all the logits, its
  gradient computed chunk by chunk in the forward pass (module docstring). `logical_axes` (the
  parameters' logical axis names): when given, the head may run split over the vocabulary under
  the batch axes (module docstring)."""
  if chunk <= 0 or chunk >= hidden_BSD.shape[1]:
    return cross_entropy_sums(head(params, hidden_BSD), targets_BS, mask_BS, z_loss_weight)
  plan = _vocab_split_plan(head, params, logical_axes, hidden_BSD, chunk)
  if plan is not None:
    return _vocab_split_sums(plan, head, params, hidden_BSD, targets_BS, mask_BS, z_loss_weight,
                             chunk)

  def local(p, h_BSD, t_BS, m_BS):
    leaves, treedef = jax.tree.flatten(p)
    used = _used_leaves(head, p, h_BSD[:, :chunk])
    w = [x for x, u in zip(leaves, used) if u]              # the head's weights
    rest = [x for x, u in zip(leaves, used) if not u]

    def head_w(w_, h_):
      it_w, it_rest = iter(w_), iter(rest)
      return head(jax.tree.unflatten(treedef, [next(it_w) if u else next(it_rest) for u in used]), h_)

    xs = (_chunks(t_BS, chunk), _chunks(m_BS, chunk))

    def sums_and_grads(w_, h_):
      def one_chunk(dw, inp):
        h_BcD, t_Bc, m_Bc = inp
        logits, pullback = jax.vjp(head_w, w_, h_BcD)
        lse, t_logit = _lse_and_target_logit(logits, t_Bc)
        sums = _sums_of_stats(lse, t_logit, m_Bc, z_loss_weight)
        dw_c, dh_BcD = pullback(_logits_cotangent(logits, lse, t_Bc, m_Bc, z_loss_weight)
                                .astype(logits.dtype))
        return jax.tree.map(jnp.add, dw, dw_c), (sums, dh_BcD)

      dw0 = jax.tree.map(jnp.zeros_like, w_)
      dw, (sums_n, dh_nBcD) = jax.lax.scan(one_chunk, dw0, (_chunks(h_, chunk), *xs))
      B, S = h_.shape[:2]
      dh_BSD = dh_nBcD.swapaxes(0, 1).reshape(B, -1, h_.shape[-1])[:, :S]
      return jax.tree.map(jnp.sum, sums_n), dw, dh_BSD

    def sums_only(w_, h_):
      def one_chunk(_, inp):
        h_BcD, t_Bc, m_Bc = inp
        return None, cross_entropy_sums(head_w(w_, h_BcD), t_Bc, m_Bc, z_loss_weight)
      _, sums_n = jax.lax.scan(one_chunk, None, (_chunks(h_, chunk), *xs))
      return jax.tree.map(jnp.sum, sums_n)

    return _with_gradient_in_forward(sums_only, sums_and_grads)(w, h_BSD)

  return _per_batch_shard(local, params, hidden_BSD, targets_BS, mask_BS)


# The head split over the vocabulary under the batch axes (module docstring): used when the
# global batch's tokens are at most this many times the vocabulary, i.e. when gathering the hidden
# rows [tokens, D] moves no more than gathering the head weight [V, D] would (measured:
# benchmarks/RESULTS.md, issue 19's LM head section; 0 turns the split off).
VOCAB_SPLIT_MAX_TOKENS_PER_VOCAB = 1.0


@dataclasses.dataclass(frozen=True)
class _VocabSplit:
  axes: tuple[str, ...]           # the mesh axes that split the batch, and now the vocabulary
  used: tuple[bool, ...]          # per parameter leaf: read by the head
  vocab_dims: tuple[int, ...]     # per used leaf: its vocabulary dimension
  stored: tuple[P, ...]           # per used leaf: its own sharding (by its logical axes)


def _vocab_split_plan(head: HeadFn, params, logical_axes, hidden_BSD: jax.Array,
                      chunk: int) -> _VocabSplit | None:
  """How to split the head over the vocabulary, or None for the per-batch-shard loop: needs a
  mesh whose only axes of size > 1 split the batch, a head whose every weight has a "vocab"
  dimension (its `logical_axes`; tied [V, D] or untied [D, V]) of one size V divisible by those
  axes, and a batch of at most VOCAB_SPLIT_MAX_TOKENS_PER_VOCAB x V tokens."""
  ctx = current_context()
  if ctx is None or logical_axes is None:
    return None
  B, S = hidden_BSD.shape[:2]
  axes = _batch_axes(ctx, B)
  n = math.prod(ctx.mesh.shape[a] for a in axes)
  if n == 1 or any(size > 1 and a not in axes for a, size in ctx.mesh.shape.items()):
    return None
  leaves = jax.tree.leaves(params)
  names = jax.tree.leaves(logical_axes, is_leaf=lambda x: isinstance(x, tuple))
  if len(names) != len(leaves):
    return None
  used = _used_leaves(head, params, hidden_BSD[:, :chunk])
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
def _grad_sharded(x: jax.Array, sharding: NamedSharding) -> jax.Array:
  """x; its gradient constrained to `sharding`."""
  return x


_grad_sharded.defvjp(lambda x, sharding: (x, None),
                     lambda sharding, _, g: (jax.lax.with_sharding_constraint(g, sharding),))


def _split_weights(plan: _VocabSplit, head: HeadFn, params):
  """(the head's weights, each with its gradient in its own sharding; the other leaves; the
  weights' in-specs as vocabulary slices; head_w(w, rest, hidden) -> the slice's logits)."""
  ctx = current_context()
  leaves, treedef = jax.tree.flatten(params)
  # their gradients leave in the weights' own sharding (else XLA may move the optimizer's update
  # of the head, its moments included, to the vocabulary slices and back)
  w = [_grad_sharded(x, NamedSharding(ctx.mesh, spec))
       for x, spec in zip([x for x, u in zip(leaves, plan.used) if u], plan.stored)]
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


def _vocab_split_sums(plan: _VocabSplit, head: HeadFn, params, hidden_BSD: jax.Array,
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
    xs = (_chunks(t_all - me * V_loc, chunk), _chunks(m_all, chunk))   # targets in the slice

    def sums_of(lse, t_logit, m):       # of the rows it reports
      return _sums_of_stats(lse, t_logit, m * own_B[:, None], z_loss_weight)

    def sums_and_grads(wv, h_):
      h_all = jax.lax.all_gather(h_, axes, axis=0, tiled=True)         # [B, S, D]

      def one_chunk(dw, inp):
        h_BcD, t_rel, m = inp
        logits, pullback = jax.vjp(lambda ww, hh: head_w(ww, rest_, hh), wv, h_BcD)
        lse, t_logit = _slice_stats(logits.astype(jnp.float32), t_rel, axes)
        dw_c, dh_BcD = pullback(_logits_cotangent(logits, lse, t_rel, m, z_loss_weight)
                                .astype(logits.dtype))
        return jax.tree.map(jnp.add, dw, dw_c), (sums_of(lse, t_logit, m), dh_BcD)

      dw0 = jax.tree.map(jnp.zeros_like, wv)
      dw, (sums_n, dh_nBcD) = jax.lax.scan(one_chunk, dw0, (_chunks(h_all, chunk), *xs))
      dh_loc = _rows_grad_to_owners(dh_nBcD, S, axes, h_.dtype)
      return jax.tree.map(lambda x: jax.lax.psum(jnp.sum(x), axes), sums_n), dw, dh_loc

    def sums_only(wv, h_):
      h_all = jax.lax.all_gather(h_, axes, axis=0, tiled=True)

      def one_chunk(_, inp):
        h_BcD, t_rel, m = inp
        lse, t_logit = _slice_stats(head_w(wv, rest_, h_BcD).astype(jnp.float32), t_rel, axes)
        return None, sums_of(lse, t_logit, m)
      _, sums_n = jax.lax.scan(one_chunk, None, (_chunks(h_all, chunk), *xs))
      return jax.tree.map(lambda x: jax.lax.psum(jnp.sum(x), axes), sums_n)

    with without_rules():
      return _with_gradient_in_forward(sums_only, sums_and_grads)(w_, h_loc)

  return jax.shard_map(local, mesh=current_context().mesh, axis_names=frozenset(axes),
                       in_specs=(w_specs, [P()] * len(rest), row_spec, row_spec, row_spec),
                       out_specs=P())(w, rest, hidden_BSD, targets_BS, mask_BS)


def chunked_target_log_probs(head: HeadFn, params, hidden_BSD: jax.Array, targets_BS: jax.Array,
                             chunk: int, entropy: bool = False, logical_axes=None):
  """log p(target) [B, S] (e.g. a policy's token log-probabilities) chunk by chunk, as above, with
  the same value and gradient as the whole; `entropy`: (log p, the entropy per position [B, S]).
  `logical_axes` (the parameters' logical axis names): when given, the head may run split over
  the vocabulary under the batch axes, under the same conditions as the loss (module docstring)."""
  B, S = targets_BS.shape
  per_chunk = target_log_probs_and_entropy if entropy else target_log_probs
  if chunk <= 0 or chunk >= S:
    return per_chunk(head(params, hidden_BSD), targets_BS)
  plan = _vocab_split_plan(head, params, logical_axes, hidden_BSD, chunk)
  if plan is not None:
    return _vocab_split_log_probs(plan, head, params, hidden_BSD, targets_BS, chunk, entropy)

  @jax.checkpoint
  def one_chunk(_, xs):
    return None, per_chunk(head(params, xs[0]), xs[1])

  _, out_nBc = jax.lax.scan(one_chunk, None, (_chunks(hidden_BSD, chunk), _chunks(targets_BS, chunk)))
  return jax.tree.map(lambda x: x.swapaxes(0, 1).reshape(B, -1)[:, :S], out_nBc)


def _vocab_split_log_probs(plan: _VocabSplit, head: HeadFn, params, hidden_BSD: jax.Array,
                           targets_BS: jax.Array, chunk: int, entropy: bool):
  """`chunked_target_log_probs` with the head split over the vocabulary as in `_vocab_split_sums`
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
    t_rel_n = _chunks(t_all - me * V_loc, chunk)                       # targets in the slice

    def own_rows(x_nBc):                  # [n, B, c] -> this device's rows [B_loc, S]
      x_BS = x_nBc.swapaxes(0, 1).reshape(B, -1)[:, :S]
      return jax.lax.dynamic_slice_in_dim(x_BS, me * B_loc, B_loc, axis=0)

    def forward(wv, h_):
      h_all = jax.lax.all_gather(h_, axes, axis=0, tiled=True)         # [B, S, D]

      def one_chunk(_, inp):
        h_BcD, t_rel = inp
        logits = head_w(wv, rest_, h_BcD).astype(jnp.float32)
        return None, _slice_stats(logits, t_rel, axes, with_mean_logit=entropy)
      _, stats_n = jax.lax.scan(one_chunk, None, (_chunks(h_all, chunk), t_rel_n))
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

    # the leaves the head does not read (`_used_leaves`), as zeros of their shapes: the backward
    # pass may hold no tracer of the forward one
    rest_shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in rest_]

    def log_probs_bwd(res, g):
      wv, h_all, t_rel_b, stats_n = res
      rest_b = [jnp.zeros(x.shape, x.dtype) for x in rest_shapes]
      # every row's cotangents: this slice's part of every row's logits gradient
      g_n = [_chunks(jax.lax.all_gather(x, axes, axis=0, tiled=True), chunk) for x in g]

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
            (_chunks(h_all, chunk), t_rel_b, stats_n[0], mean_n, g_n[0], g_ent_n))
      return dw, _rows_grad_to_owners(dh_nBcD, S, axes, h_all.dtype)

    log_probs.defvjp(log_probs_fwd, log_probs_bwd)
    with without_rules():
      out = log_probs(w_, h_loc)
    return out if entropy else out[0]

  out_specs = (row_spec, row_spec) if entropy else row_spec
  return jax.shard_map(local, mesh=current_context().mesh, axis_names=frozenset(axes),
                       in_specs=(w_specs, [P()] * len(rest), row_spec, row_spec),
                       out_specs=out_specs)(w, rest, hidden_BSD, targets_BS)


def token_loss_sums(model_def: ModelDef, params, micro: dict, *, z_loss_weight: float,
                    chunk: int) -> tuple[jax.Array, jax.Array, jax.Array, dict]:
  """(loss sum, z-loss sum, token count, the model's auxiliary outputs) of one micro-batch."""
  args = (micro["inputs"], micro["inputs_position"], micro["inputs_segmentation"])
  mask_BS = micro["targets_segmentation"] != 0
  if chunk <= 0:
    logits_BSV, aux = model_def.apply_with_aux(params, *args)
    return (*cross_entropy_sums(logits_BSV, micro["targets"], mask_BS, z_loss_weight), aux)
  hidden_BSD, aux = model_def.apply_hidden(params, *args)
  return (*chunked_cross_entropy_sums(model_def.head, params, hidden_BSD, micro["targets"],
                                      mask_BS, z_loss_weight, chunk, model_def.logical_axes), aux)
