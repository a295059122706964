"""Pipeline parallelism over the `stage` mesh axis: the schedule and the loop that runs a stage
function on every stage at once.

S stages (the `stage` mesh axis), M microbatches (`num_pipeline_microbatches`), R repeats
(`num_pipeline_repeats`, a circular pipeline). The layers are cut into V = S x R virtual stages of
L / V consecutive layers; virtual stage v = r x S + s runs on stage s in its repeat r (R = 1:
stage s holds the s-th contiguous block of layers, a GPipe fill / drain schedule).

One SPMD program: the stage function is `jax.vmap`ped over a leading stage dimension whose
activations and weights are sharded over `stage` (`spmd_axis_name`: the sharding constraints
inside the layers gain the stage axis on that dimension). Iteration t (of M x R + S - 1) runs
every stage on its input, then shifts the outputs one stage on (`jnp.roll` along the sharded
dimension: XLA lowers it to a collective permute between neighbouring stages). Task k = t - s is
stage s's work at iteration t: microbatch k mod M in repeat k // M; idle (bubble) iterations
compute on stale inputs whose results are never written. Stage 0 reads its input from a loop
buffer of M microbatches that the last stage writes back into — the microbatches at the start,
a microbatch's output of repeat r when repeat r + 1 needs it (hence M >= S when R > 1), the
final outputs at the end.

Microbatch m is the rows m, m + M, m + 2M, … of the batch (as gradient accumulation splits it), so
every device's rows hold an equal share of each microbatch. The bubble fraction (idle share of
stage time) is (S - 1) / (M x R + S - 1).
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from MaxText.sharding.rules import Rules, current_context, logical_to_spec, use_rules

STAGE = "stage"   # the mesh axis


@dataclass(frozen=True)
class Schedule:
  stages: int
  microbatches: int
  repeats: int = 1

  @property
  def iterations(self) -> int:
    return self.microbatches * self.repeats + self.stages - 1

  @property
  def bubble_fraction(self) -> float:
    return (self.stages - 1) / self.iterations

  def describe(self) -> str:
    kind = "GPipe fill/drain" if self.repeats == 1 else f"circular, {self.repeats} repeats"
    return (f"pipeline: {self.stages} stages x {self.microbatches} microbatches ({kind}), "
            f"{self.iterations} iterations, bubble fraction {self.bubble_fraction:.3f}")


def problems(*, num_layers: int, stages: int, microbatches: int, repeats: int,
             batch: int) -> list[tuple[str, str]]:
  """(keys, problem) for a schedule that cannot run: the layers must split into stages x repeats
  equal virtual stages, the microbatches split the batch, and a circular pipeline needs at least
  as many microbatches as stages (the last stage hands each microbatch back to the first)."""
  out = []
  if num_layers % (stages * repeats):
    out.append(("num_decoder_layers / ici_pipeline_parallelism / dcn_pipeline_parallelism / "
                "num_pipeline_repeats",
                f"num_decoder_layers={num_layers} does not split into {stages} stages x "
                f"{repeats} repeats = {stages * repeats} equal groups of layers"))
  if batch % microbatches:
    out.append(("num_pipeline_microbatches / per_device_batch_size",
                f"num_pipeline_microbatches={microbatches} does not divide the {batch} rows of a "
                f"(gradient accumulation) micro-batch"))
  if repeats > 1 and microbatches < stages:
    out.append(("num_pipeline_microbatches / num_pipeline_repeats",
                f"a circular pipeline (num_pipeline_repeats={repeats}) needs at least as many "
                f"microbatches as stages: num_pipeline_microbatches={microbatches} < {stages}"))
  return out


# ---- the schedule in force (set by the train step around the loss) -----------------------------
_SCHEDULE: contextvars.ContextVar[Schedule | None] = contextvars.ContextVar("pipeline", default=None)


@contextlib.contextmanager
def use_schedule(schedule: Schedule | None):
  """Pipelines the stacks built with `pipeline=True` that run inside (when stages > 1)."""
  token = _SCHEDULE.set(schedule)
  try:
    yield
  finally:
    _SCHEDULE.reset(token)


def active() -> Schedule | None:
  schedule = _SCHEDULE.get()
  ctx = current_context()
  if schedule is None or schedule.stages <= 1 or ctx is None:
    return None
  if ctx.mesh.shape.get(STAGE, 1) != schedule.stages:
    raise ValueError(f"pipeline schedule of {schedule.stages} stages on a mesh with "
                     f"{ctx.mesh.shape.get(STAGE, 1)}")
  return schedule


def without_stage(rules: Rules) -> Rules:
  """The rules with the stage axis taken out (inside the stage function it is the vmapped one)."""
  return tuple((name, tuple(a for a in axes if a != STAGE)) for name, axes in rules)


# ---- microbatches ------------------------------------------------------------------------------
def split(a: jax.Array, m: int, axis: int = 0) -> jax.Array:
  """[..., B, ...] → [..., M, B/M, ...] at `axis`; microbatch j = rows j, j + M, …"""
  b = a.shape[axis]
  a = a.reshape(*a.shape[:axis], b // m, m, *a.shape[axis + 1:])
  return jnp.swapaxes(a, axis, axis + 1)


def join(a: jax.Array) -> jax.Array:
  """The inverse of `split` at axis 0."""
  return jnp.swapaxes(a, 0, 1).reshape(a.shape[0] * a.shape[1], *a.shape[2:])


def _constrain(a: jax.Array, lead: tuple, batched: bool) -> jax.Array:
  """Pins the leading dims `lead` (mesh axis or None each) and, for a microbatched leaf, its rows
  and sequence as the activations' (`activation_batch` / `activation_length`, stage taken out)."""
  ctx = current_context()
  if ctx is None:
    return a
  rules = without_stage(ctx.rules)
  rest = a.shape[len(lead):]
  if batched and len(rest) >= 2:
    names = ("activation_batch", "activation_length", *[None] * (len(rest) - 2))
    tail = tuple(logical_to_spec(names, rest, rules, ctx.mesh))
  else:
    tail = (None,) * len(rest)
  return jax.lax.with_sharding_constraint(a, NamedSharding(ctx.mesh, PartitionSpec(*lead, *tail)))


# ---- the loop ----------------------------------------------------------------------------------
def run(schedule: Schedule, stage_fn: Callable, per_stage: Any, carry: Any, batched: Any,
        per_micro: Any) -> Any:
  """Runs the pipeline; returns the carry for the whole batch.

  `stage_fn(weights, micro, carry, m)` → carry: one virtual stage on one microbatch; `weights`
  is `per_stage` (leaves [R, S, ...]) at the stage's (repeat, stage), `micro` is `per_micro`
  (leaves [M, ...]) at its microbatch m. `carry` (leaves [B, ...] where `batched`, a matching tree
  of bools, says so; the others are statistics that add up over microbatches) goes through the
  stages; the result is the joined microbatches' carries, the statistics as init + sum over
  microbatches of (final - init)."""
  S, M, R = schedule.stages, schedule.microbatches, schedule.repeats
  ctx = current_context()
  assert ctx is not None
  inner_rules = without_stage(ctx.rules)

  buf = jax.tree.map(lambda a, b: _constrain(split(a, M), (None,), True) if b else
                     jnp.broadcast_to(a, (M, *a.shape)), carry, batched)
  state = jax.tree.map(lambda a, b: _constrain(jnp.zeros((S, *a.shape[1:]), a.dtype), (STAGE,), b),
                       buf, batched)
  per_stage = jax.tree.map(
      lambda a: jax.lax.with_sharding_constraint(
          a, NamedSharding(ctx.mesh, PartitionSpec(None, STAGE, *[PartitionSpec.UNCONSTRAINED] *
                                                   (a.ndim - 2)))), per_stage)

  def one_stage(weights_R, c, m, r):
    weights = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, r, keepdims=False),
                           weights_R)
    micro = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, m, keepdims=False), per_micro)
    with use_rules(ctx.mesh, inner_rules):
      return stage_fn(weights, micro, c, m)

  stages = jax.vmap(one_stage, in_axes=(1, 0, 0, 0), spmd_axis_name=STAGE)
  s_idx = jnp.arange(S, dtype=jnp.int32)

  def iteration(loop, t):
    state, buf = loop
    k = t - s_idx                                       # each stage's task
    m, r = k % M, jnp.clip(k // M, 0, R - 1)
    first = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, t % M, keepdims=False), buf)
    inputs = jax.tree.map(lambda a, f, b: _constrain(
        jnp.where((s_idx == 0).reshape(S, *[1] * f.ndim), f[None], a), (STAGE,), b),
        state, first, batched)
    out = stages(per_stage, inputs, m, r)
    out = jax.tree.map(lambda a, b: _constrain(a, (STAGE,), b), out, batched)
    done = t - (S - 1)                                  # the last stage's task
    valid = (done >= 0) & (done < M * R)
    slot = jnp.clip(done, 0, M * R - 1) % M
    buf = jax.tree.map(lambda a, o: jax.lax.dynamic_update_index_in_dim(
        a, jnp.where(valid, o[S - 1], jax.lax.dynamic_index_in_dim(a, slot, keepdims=False)),
        slot, 0), buf, out)
    state = jax.tree.map(lambda a, b: _constrain(jnp.roll(a, 1, axis=0), (STAGE,), b), out,
                         batched)
    return (state, buf), None

  (_, buf), _ = jax.lax.scan(iteration, (state, buf), jnp.arange(schedule.iterations,
                                                                 dtype=jnp.int32))
  return jax.tree.map(lambda a, init, b: join(a) if b else init + jnp.sum(a - init, axis=0)
                      .astype(init.dtype), buf, carry, batched)


def batched_like(tree: Any, rows: int, length: int, axis: int = 0) -> Any:
  """A tree of bools: which leaves are per-token arrays, [.., B, S, ...] at `axis` (the residual
  stream's batch and sequence), the rest not (statistics, tables, flags)."""
  def test(a):
    shape = getattr(a, "shape", None)
    return (shape is not None and len(shape) >= axis + 2
            and tuple(shape[axis:axis + 2]) == (rows, length))
  return jax.tree.map(test, tree)


def schedule_of(cfg: Any, mesh_shape: dict[str, int]) -> Schedule | None:
  """The schedule of a run (`cfg`: the config's `num_pipeline_*` keys), None without stages."""
  stages = int(mesh_shape.get(STAGE, 1))
  if stages <= 1:
    return None
  return Schedule(stages, cfg.num_pipeline_microbatches or stages, cfg.num_pipeline_repeats)
