"""The optax optimizer: global-norm clipping → AdamW (decoupled weight decay on matrices only)
with a warmup + cosine, warmup-stable-decay (WSD) or constant learning-rate schedule.

`make_optimizer` returns an `Optimizer`: the optax chain's `init` and `update` (its state — optax's
ScaleByAdamState, ScaleByScheduleState, ... — is what checkpoints hold), plus `apply`, the same
update fused: one elementwise pass per parameter that writes the new parameter and both moments,
with the non-finite guard folded in (`where(finite, new, old)` inside the pass, so XLA updates
the donated buffers in place instead of copying the old moments first). `apply` is bit for bit the
chain followed by `optax.apply_updates` and the guard (tests/test_fused_adamw.py, optax as the
oracle: tests/optax_oracle.py). `apply` is the train step's one update path (train/step.py:
`guarded_update`, ZeRO-1 included, and GRPO's step); the chain's `update` is only the oracle. What
the config can select — the schedules, clipping, weight decay and its mask, a family's frozen
parameters, LoRA (the step hands `apply` the adapters only) — is all in `apply`; an optimizer
without a fused form would supply its own `apply` with the same contract (the guard, `whole` and
`gather`), not a second path through the step. `data_axes` (config `shard_optimizer_over_data`, on by default): the moments are sharded
over the mesh's data axes too (ZeRO-1, train/state.py and sharding/zero.py).

The moments' dtype is declared once (`Optimizer.moment_dtype`, config `moment_dtype`; auto: the
weights' `weight_dtype`, as MaxText's `mu_dtype` unset and optax's second moment do): `init`
creates both moments in it, and `apply` (like the chain, optax's `mu_dtype`) computes each new
moment in the promoted dtype of the gradient and the old moment, takes the update from that (read
through the stored moment, bit for bit: `through_stored`, which makes it one pass on a TPU), and
stores the moment back in its own dtype — so the state a step returns has the dtypes of the state
it took, whatever the gradients' dtype (bf16 weights' gradients are float32 once divided by the
token count, train/update.py), and a compiled step and the state it is called with cannot disagree.

"Matrices" are told apart by the parameters' logical axes, not their rank: a scanned stack of norm
scales is [layers, D] but is still a vector per layer and is not decayed.

A family's frozen parameters (`Family.frozen`: top-level names, e.g. a carried
multi-token-prediction block) get updates of -0.0 after AdamW: p + (-0.0) is p bit for bit for every p, signed zeros
included. (Their gradients are zero, so their AdamW moments stay zero; they still take optimizer
state, which keeps the state's structure that of the parameters.)"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence, cast

import jax
import jax.numpy as jnp
import optax

from MaxText.config.schema import Config


def learning_rate_schedule(cfg: Config) -> optax.Schedule:
  peak, steps, warmup = cfg.learning_rate, cfg.steps, min(cfg.warmup_steps, cfg.steps)
  final = peak * cfg.final_lr_fraction
  warm = optax.linear_schedule(0.0, peak, max(warmup, 1))
  if cfg.lr_schedule == "constant":
    return optax.join_schedules([warm, optax.constant_schedule(peak)], [warmup])
  if cfg.lr_schedule == "cosine":
    cos = optax.cosine_decay_schedule(peak, max(steps - warmup, 1), alpha=cfg.final_lr_fraction)
    return optax.join_schedules([warm, cos], [warmup])
  # wsd: warmup, hold the peak, then decay linearly to `final` over the last wsd_decay_fraction
  decay = max(int(round(steps * cfg.wsd_decay_fraction)), 1)
  stable = max(steps - warmup - decay, 0)
  return optax.join_schedules(
      [warm, optax.constant_schedule(peak), optax.linear_schedule(peak, final, decay)],
      [warmup, warmup + stable])


def decay_mask(logical_axes):
  """True for parameters with at least two axes besides the stacked "layers" axis."""
  return jax.tree.map(lambda axes: sum(a != "layers" for a in axes) >= 2, logical_axes,
                      is_leaf=lambda x: isinstance(x, tuple))


def freeze(frozen_mask) -> optax.GradientTransformation:
  """Updates of -0.0 where `frozen_mask` is True (x + -0.0 == x for every x, signed zeros
  included; +0.0 would turn -0.0 into +0.0)."""
  return optax.stateless(lambda updates, params=None: jax.tree.map(
      lambda u, frozen: jnp.full_like(u, -0.0) if frozen else u, updates, frozen_mask))


class Optimizer(NamedTuple):
  """An optax transformation (`init`: the state's structure; `update`: the oracle) and its
  fused, guarded form `apply(grads, state, params, grad_norm, finite, whole=None, gather=None)
  -> (params, state)`, the one the train step runs.
  `data_axes`: the mesh axes the moments are sharded over besides their parameter's (ZeRO-1;
  empty: none). `moment_dtype`: the dtype `init` gives both AdamW moments, which `apply` keeps."""
  init: Callable
  update: Callable
  apply: Callable
  data_axes: tuple[str, ...] = ()
  moment_dtype: Any = jnp.float32   # both AdamW moments' dtype (`moment_dtype`)

  @property
  def shard_over_data(self) -> bool:
    return bool(self.data_axes)


def make_optimizer(cfg: Config, logical_axes, frozen: Sequence[str] = (),
                   data_axes: Sequence[str] = ()) -> Optimizer:
  """`logical_axes`: the parameters' logical axis names (ModelDef.logical_axes); `frozen`: the
  top-level parameters left out of training; `data_axes`: the mesh's data axes
  (sharding/zero.py: `data_axes`), which the moments are sharded over with
  `shard_optimizer_over_data` (ZeRO-1)."""
  schedule = learning_rate_schedule(cfg)
  decay = decay_mask(logical_axes)
  moments = moment_dtype(cfg)
  tx = optax.adamw(schedule, b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.adam_eps,
                   weight_decay=cfg.weight_decay, mask=decay, mu_dtype=moments)
  if cfg.max_grad_norm > 0:
    tx = optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), tx)
  mask = {name: jax.tree.map(lambda _, n=name: n in frozen, axes,
                             is_leaf=lambda x: isinstance(x, tuple))
          for name, axes in logical_axes.items()}
  if frozen:
    tx = optax.chain(tx, freeze(mask))
  apply = fused_adamw(schedule, b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.adam_eps,
                      weight_decay=cfg.weight_decay, decay_mask=decay,
                      max_grad_norm=cfg.max_grad_norm, frozen_mask=mask)
  return Optimizer(with_moment_dtype(tx.init, moments), tx.update, apply,
                   data_axes=tuple(data_axes) if cfg.shard_optimizer_over_data else (),
                   moment_dtype=moments)


def moment_dtype(cfg: Config) -> jnp.dtype:
  """The AdamW moments' dtype: `moment_dtype`, or with auto the weights' (`weight_dtype`)."""
  return jnp.dtype(cfg.weight_dtype if cfg.moment_dtype == "auto" else cfg.moment_dtype)


def with_moment_dtype(init: Callable, dtype: Any) -> Callable:
  """optax's `init` with both AdamW moments in `dtype` (optax's `mu_dtype` sets the first only;
  its update keeps the second in the dtype the state holds it in)."""
  def moments_init(params: Any) -> Any:
    state = init(params)
    adam = find_state(state, optax.ScaleByAdamState)
    cast = lambda tree: jax.tree.map(lambda x: x.astype(dtype), tree)
    new = adam._replace(mu=cast(adam.mu), nu=cast(adam.nu))
    return jax.tree.map(lambda s: new if isinstance(s, optax.ScaleByAdamState) else s, state,
                        is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
  return moments_init


def find_state(tree: Any, cls: type) -> Any:
  """The one node of type `cls` (an optax state, e.g. ScaleByAdamState) in `tree` — an optimizer
  state or a tree of the same structure (its shardings); a ValueError unless exactly one."""
  is_cls = lambda x: isinstance(x, cls)
  found = [s for s in jax.tree.leaves(tree, is_leaf=is_cls) if is_cls(s)]
  if len(found) != 1:
    raise ValueError(f"expected one {cls.__name__} in the optimizer state, found {len(found)}")
  return found[0]


def through_stored(stored: jax.Array, value: jax.Array) -> jax.Array:
  """`value` bit for bit, written as a function of `stored` (= value.astype(stored's dtype)):
  `widened` (stored cast back to value's dtype) where its bits are value's, else value — for
  every input (infinities, NaN, a value the narrower dtype overflows on, subnormals whatever the
  flush-to-zero mode: bits are compared, not values). Why: with moments stored narrower than
  they are computed in (bf16 moments, float32 gradients: bf16 weights' gradients divided by the
  float32 token count), the parameter's update must read the unrounded moments (optax's chain
  does). Read directly, the rounded moments' only user is the state, and XLA:TPU compiles two
  passes per parameter: one writing the parameter, one recomputing the moments to write them
  (~1.4x the bytes moved). Read through the stored moments, the parameter's pass consumes them
  and XLA makes one pass writing all three, as it does when the dtypes agree. Same dtype:
  `stored` itself (it is `value`)."""
  if stored.dtype == value.dtype:
    return stored
  widened = stored.astype(value.dtype)
  bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
  return jnp.where(bits(widened) == bits(value), widened, value)


def fused_adamw(schedule: optax.Schedule, *, b1: float, b2: float, eps: float,
                weight_decay: float, decay_mask, max_grad_norm: float, frozen_mask) -> Callable:
  """`apply` of `Optimizer`: clip → AdamW (masked decay, `schedule`) → freeze → apply_updates →
  keep the old parameters and state unless `finite`, written as one elementwise expression per
  moment and one per parameter (the parameter's reads the moments as written, so nothing reads an
  old moment after its new value is written: no copies). Each operation is the one optax's chain
  performs, in the same order and dtypes, so the results are the same bits; skipped steps advance
  neither count (as the guard over the whole state)."""
  eps_root = 0.0

  def apply(grads: Any, state: Any, params: Any, grad_norm: jax.Array, finite: jax.Array,
            whole: Any = None, gather: Callable | None = None) -> tuple[Any, Any]:
    """`gather` (ZeRO-1: `grads`, `state` and `params` are each device's part on the moments'
    sharding): a function that all-gathers a tree of such parts onto the parameters' sharding,
    and `whole`, the parameters on it. The new parameter is then `whole + gather(where(finite,
    u, -0.0))` — the same bits as where(finite, p + u, p), as p + -0.0 is p — so each parameter
    gathers one array (XLA gathers both operands of the guard's where otherwise)."""
    adam = find_state(state, optax.ScaleByAdamState)
    sched = find_state(state, optax.ScaleByScheduleState)
    # (typed ArrayLike: given the state's count array, it returns an array)
    count_inc = cast(jax.Array, optax.safe_increment(adam.count))
    bc1 = 1 - b1 ** count_inc   # optax.tree.bias_correction's factors
    bc2 = 1 - b2 ** count_inc
    step_size = -1 * schedule(sched.count)
    trigger = jnp.squeeze(grad_norm < max_grad_norm)

    def moments(g, mu, nu):
      """(mu, nu) kept by the guard, in the promoted dtype of `g` and the old moment (the update
      is taken from these, as optax's chain does) — cast back to the state's dtypes below."""
      if max_grad_norm > 0:
        g = jax.lax.select(trigger, g, (g / grad_norm.astype(g.dtype)) * max_grad_norm)
      mu_new = (1 - b1) * (g ** 1) + b1 * mu
      nu_new = (1 - b2) * (g ** 2) + b2 * nu
      return jnp.where(finite, mu_new, mu), jnp.where(finite, nu_new, nu)

    def parameter(mu, nu, p, decayed, frozen):
      # from the moments as kept, read through the stored ones (`through_stored`: the kept
      # values bit for bit): when finite they are the new ones, otherwise p is kept anyway;
      # reading them (not recomputing from the old ones) lets XLA overwrite the old moments in
      # place instead of copying them for this pass
      u = (mu / bc1.astype(mu.dtype)) / (jnp.sqrt(nu / bc2.astype(nu.dtype) + eps_root) + eps)
      if decayed and not (isinstance(weight_decay, (int, float)) and weight_decay == 0.0):
        u = u + weight_decay * p
      u = jnp.array(step_size, dtype=u.dtype) * u
      if frozen:
        u = jnp.full_like(u, -0.0)
      if gather is not None:   # ZeRO-1: the guarded update, gathered in its dtype, then added
        return jnp.where(finite, u, jnp.array(-0.0, u.dtype))
      return jnp.where(finite, jnp.asarray(p + u).astype(jnp.asarray(p).dtype), p)

    out = jax.tree.map(moments, grads, adam.mu, adam.nu)
    mu = jax.tree.map(lambda _, o: o[0], grads, out)
    nu = jax.tree.map(lambda _, o: o[1], grads, out)
    # the moments stored in the state's dtypes (optax: `mu_dtype`, `cast_like(nu, state.nu)`)
    mu_stored = jax.tree.map(lambda new, old: new.astype(old.dtype), mu, adam.mu)
    nu_stored = jax.tree.map(lambda new, old: new.astype(old.dtype), nu, adam.nu)
    # the update from the unrounded moments, read through the stored ones (`through_stored`)
    new_params = jax.tree.map(parameter, jax.tree.map(through_stored, mu_stored, mu),
                              jax.tree.map(through_stored, nu_stored, nu), params, decay_mask,
                              frozen_mask)
    if gather is not None:   # p + -0.0 is p: the same bits as the guard's where(finite, p + u, p)
      new_params = jax.tree.map(lambda p, u: jnp.asarray(p + u).astype(p.dtype), whole,
                                gather(new_params))
    mu, nu = mu_stored, nu_stored
    new_adam = optax.ScaleByAdamState(count=jnp.where(finite, count_inc, adam.count), mu=mu, nu=nu)
    new_sched = optax.ScaleByScheduleState(
        count=jnp.where(finite, optax.safe_increment(sched.count), sched.count))
    replaced = {optax.ScaleByAdamState: new_adam, optax.ScaleByScheduleState: new_sched}
    new_state = jax.tree.map(lambda s: replaced.get(type(s), s), state,
                             is_leaf=lambda s: type(s) in replaced)
    return new_params, new_state

  return apply
