"""The pattern stack: a model's decoder layers given as one layer kind per layer (any hashable value
a family chooses, e.g. "dense" / "moe", or Gemma 4's sliding / full / kv-shared), built by the
family's `make_layer(kind, rngs)`.

Scanned (`scan_layers=true`), the kinds are cut into runs (`plan_runs`): each run is a block of
kinds repeated `repeats` times — a repeating pattern with an optional different prefix or suffix,
e.g. [dense] x 1 then [moe] x 3 (the first k dense layers), or Gemma 4's [4 sliding + 1 full] x 3
then the same block with shared K/V x 4. Each run is one `jax.lax.scan` over its repeats whose
body is one block (one compiled body per run); the parameters of block member m carry a leading
"layers" axis of length `repeats`. Unscanned, the layers run one after another.

Either way each layer call is wrapped in `jax.checkpoint` per `remat_policy` (remat per layer,
also inside a scanned block). A layer is called `layer(carry, *args) -> carry`, where the carry is
any pytree (the hidden state, MoE statistics, K/V handed to later layers); `xs`, when given, is a
pytree of per-layer inputs with a leading axis of length num_layers, and layer i is then called
`layer(carry, *args, per_layer=xs[i])`. `method` names another method of the layers to call the
same way (e.g. a decoding step that carries the decoding cache).

Parameter paths (below the stack):  scanned  runs/<run>/<member>/...   (leading axis: repeat)
                                    unscanned  layers/<i>/...
`location(kinds, scan, i)` says where layer i lives.

Under an inspection probe (MaxText/layers/sites.py) each layer call runs in a frame that knows the
layer's index (traced inside a scan), marks the residual stream — the carry's first element, or
the carry itself — as `resid_pre.{i}` / `resid_post.{i}`, and hands back the values captured inside
the layer; a scanned run keeps them in buffers with one row per layer asked for (not per repeat),
so capturing one layer of many costs that layer's values only.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from MaxText.layers import pipeline, sites
from MaxText.layers.saved import ATTENTION, MLP_DOWN, OUT_PROJ, QKV_PROJ

Kind = TypeVar("Kind", bound=Hashable)   # a layer kind of a PatternStack (its own type per model)

_save = jax.checkpoint_policies.save_only_these_names

REMAT_POLICIES: dict[str, Callable | None] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    # named saves (as MaxText's policies of the same names), each a memory / recompute trade: the
    # attention's residuals (its forward is not rerun), the q/k/v projections, both, or every value
    # of the attention block (the MLP recomputed), or everything but the MLP's wide gate/up outputs
    "save_attention": _save(*ATTENTION),
    "save_qkv_proj": _save(QKV_PROJ),
    "save_qkv_attention": _save(QKV_PROJ, *ATTENTION),
    "save_dot_except_mlp": _save(QKV_PROJ, OUT_PROJ, *ATTENTION),
    "save_dot_except_mlp_in": _save(QKV_PROJ, OUT_PROJ, MLP_DOWN, *ATTENTION),
    # keep the outputs of the weight matmuls (projections, MLP; `matmul_out`: the bf16 ones) and the
    # attention's residuals (flash kernels: output + log-sum-exp, ours and splash's on TPU; the bf16
    # dot-product core: also its q, k, v); recompute the rest
    "save_matmuls": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names("matmul_out", "flash_out", "flash_lse",
                                                      "splash_residuals", "attention_residuals")),
}


# `unroll` of the layer scans (jax.lax.scan): layers per loop iteration (for A/Bs)
SCAN_UNROLL = 1


def remat(fn: Callable, policy: str, *, prevent_cse: bool = True) -> Callable:
  if policy == "none":
    return fn
  return jax.checkpoint(fn, policy=REMAT_POLICIES[policy], prevent_cse=prevent_cse)


@dataclass(frozen=True)
class Run:
  """Layers [start, stop): `block` (kinds) repeated `repeats` times."""
  start: int
  block: tuple
  repeats: int

  @property
  def stop(self) -> int:
    return self.start + len(self.block) * self.repeats


@functools.lru_cache(maxsize=None)
def plan_runs(kinds: tuple[Hashable, ...]) -> tuple[Run, ...]:
  """Cuts `kinds` into runs with the fewest layers in all blocks together (what is compiled), then
  the fewest runs. A run's block is the shortest period of its layers."""
  index: dict = {}
  ids = np.asarray([index.setdefault(k, len(index)) for k in kinds])
  n = len(kinds)
  # same[p][t]: layer t and layer t + p are of one kind; prefix sums count the mismatches
  mismatches = {p: np.concatenate([[0], np.cumsum(ids[:-p] != ids[p:])]) for p in range(1, n)}

  def period(j: int, i: int) -> int:   # of kinds[j:i]
    m = i - j
    for p in range(1, m):
      if m % p == 0 and mismatches[p][i - p] == mismatches[p][j]:
        return p
    return m

  best: list = [(0, 0, 0, 0)] + [None] * n   # (block layers, runs, cut, period)
  for i in range(1, n + 1):
    for j in range(i):
      p = period(j, i)
      cost = (best[j][0] + p, best[j][1] + 1)
      if best[i] is None or cost < best[i][:2]:
        best[i] = (*cost, j, p)
  runs, i = [], n
  while i > 0:
    _, _, j, p = best[i]
    runs.append(Run(j, tuple(kinds[j:j + p]), (i - j) // p))
    i = j
  return tuple(reversed(runs))


def describe(kinds: Sequence[Hashable]) -> str:
  """The runs of `kinds` for a log line: "35 layers: 3 x [sliding x 4, full] + 4 x [...]"."""
  def block(kinds_):
    parts: list[list] = []
    for k in map(str, kinds_):
      if parts and parts[-1][0] == k:
        parts[-1][1] += 1
      else:
        parts.append([k, 1])
    return ", ".join(k if n == 1 else f"{k} x {n}" for k, n in parts)
  runs = plan_runs(tuple(kinds))
  return f"{len(kinds)} layers: " + " + ".join(f"{r.repeats} x [{block(r.block)}]" for r in runs)


def location(kinds: Sequence[Hashable], scan: bool, i: int) -> tuple[tuple, int | None]:
  """Where layer i lives below the stack: (path, index on the stacked axis or None)."""
  if not scan:
    return ("layers", i), None
  for r, run in enumerate(plan_runs(tuple(kinds))):
    if run.start <= i < run.stop:
      repeat, member = divmod(i - run.start, len(run.block))
      return ("runs", r, member), repeat
  raise IndexError(f"layer {i} is outside the model's {len(kinds)} layers")


def _prepend_layers_axis(module: nnx.Module) -> None:
  for _, var in nnx.iter_graph(module):
    if isinstance(var, nnx.Variable) and "logical_axes" in var.get_metadata():
      axes = var.get_metadata()["logical_axes"]
      if len(axes) + 1 == len(var.get_value().shape):
        var.set_metadata("logical_axes", ("layers", *axes))


def _stacked(make_layer: Callable, kind: Hashable, repeats: int, rngs: nnx.Rngs) -> nnx.Module:
  """`repeats` layers of one kind with their parameters stacked on a leading "layers" axis."""
  @nnx.split_rngs(splits=repeats)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def make(r):
    return make_layer(kind, r)

  layers = make(rngs)
  _prepend_layers_axis(layers)
  return layers


def _call(graphdef, state, carry, args: tuple, x_i, method: str | None = None):
  layer = nnx.merge(graphdef, state)
  fn = layer if method is None else getattr(layer, method)
  return fn(carry, *args) if x_i is None else fn(carry, *args, per_layer=x_i)


def _at(xs, i):
  return None if xs is None else jax.tree.map(lambda a: a[i], xs)


def _run_xs(xs, run):
  """The per-layer inputs `xs` [L, ...] of a run's layers as [repeats, block, ...]."""
  p = len(run.block)
  return None if xs is None else jax.tree.map(
      lambda a: a[run.start:run.stop].reshape(run.repeats, p, *a.shape[1:]), xs)


class PatternStack(nnx.Module):
  """`make_layer(kind, rngs)` builds one layer of `kind`; see the module docstring."""

  def __init__(self, make_layer: Callable[[Kind, nnx.Rngs], nnx.Module],
               kinds: Sequence[Kind], *, scan: bool, remat_policy: str, rngs: nnx.Rngs,
               pipeline: bool = False):
    self.scan = scan
    self.remat_policy = remat_policy
    self.kinds = tuple(kinds)
    self.pipelined = pipeline   # split over the `stage` axis under a pipeline schedule
    if scan:
      self.plan = plan_runs(tuple(kinds))
      self.runs = nnx.List([nnx.List([_stacked(make_layer, kind, run.repeats, rngs)
                                      for kind in run.block]) for run in self.plan])
    else:
      self.layers = nnx.List([make_layer(kind, rngs) for kind in kinds])

  def __call__(self, carry, *args, xs=None, method: str | None = None):
    probe = sites.active()
    if probe is not None:
      return self._probed(probe, carry, args, xs, method)
    schedule = pipeline.active() if self.pipelined and method is None else None
    if schedule is not None:
      return self._pipelined(schedule, carry, args, xs)
    if not self.scan:
      for i, layer in enumerate(self.layers):
        graphdef, state = nnx.split(layer)
        step = remat(lambda s, c, x, g=graphdef: _call(g, s, c, args, x, method),
                     self.remat_policy)
        carry = step(state, carry, _at(xs, i))
      return carry
    for run, members in zip(self.plan, self.runs):
      graphdefs, states = zip(*(nnx.split(m) for m in members))
      xs_run = _run_xs(xs, run)
      steps = [remat(lambda s, c, x, g=g: _call(g, s, c, args, x, method), self.remat_policy,
                     prevent_cse=False) for g in graphdefs]

      def body(c, inp, steps=steps):
        states_i, xs_i = inp
        for m, step in enumerate(steps):
          c = step(states_i[m], c, _at(xs_i, m))
        return c, None

      carry, _ = jax.lax.scan(body, carry, (list(states), xs_run), unroll=SCAN_UNROLL)
    return carry

  # ---- pipelined over the `stage` mesh axis (layers/pipeline.py) ---------------------------------
  def _sources(self) -> dict:
    """Layer i → (source key, (graphdef, state with a leading layers axis), row in it)."""
    out = {}
    if self.scan:
      for r, (run, members) in enumerate(zip(self.plan, self.runs)):
        parts = [nnx.split(m) for m in members]
        for rep in range(run.repeats):
          for m in range(len(run.block)):
            out[run.start + rep * len(run.block) + m] = ((r, m), parts[m], rep)
    else:
      for i, layer in enumerate(self.layers):
        graphdef, state = nnx.split(layer)
        out[i] = ((i,), (graphdef, jax.tree.map(lambda a: a[None], state)), 0)
    return out

  def _pipelined(self, schedule: pipeline.Schedule, carry, args: tuple, xs):
    """The layers as S x R virtual stages of equal length, each a pattern stack of its own
    (`plan_runs` of the per-position kinds, one scan per run). A position whose kind differs
    between virtual stages (a run of the whole stack crossing a stage boundary) holds one weight
    set per kind it takes and picks its branch by virtual stage (`lax.switch`; vmapped over the
    stages, every branch runs and the others' results are dropped). The parameters keep their
    layout (checkpoints do not depend on the stage count); each step gathers them per virtual
    stage: a reshape of the stacked layers axis when a stage's layers are one run's rows."""
    S, M, R = schedule.stages, schedule.microbatches, schedule.repeats
    kinds, V = self.kinds, schedule.stages * schedule.repeats
    Lv = len(kinds) // V
    sources = self._sources()
    plan = plan_runs(tuple(tuple(kinds[v * Lv + j] for v in range(V)) for j in range(Lv)))
    weights, graphdefs, branches = [], [], []
    for run in plan:
      p = len(run.block)
      w_run, g_run, b_run = [], [], []
      for m, mixed in enumerate(run.block):
        distinct = list(dict.fromkeys(mixed))
        w_m, g_m = [], []
        for d in distinct:
          ids = []
          for v in range(V):
            for rep in range(run.repeats):
              j = run.start + rep * p + m
              # a virtual stage whose layer here is of another kind takes a stand-in of kind d
              # (its branch's result is dropped, so the stand-in gets no gradient)
              v_d = v if kinds[v * Lv + j] == d else mixed.index(d)
              ids.append(v_d * Lv + j)
          state = _gather(sources, ids)
          w_m.append(jax.tree.map(lambda a, n=run.repeats: a.reshape(R, S, n, *a.shape[1:]),
                                  state))
          g_m.append(sources[ids[0]][1][0])
        w_run.append(w_m)
        g_run.append(g_m)
        b_run.append(jnp.asarray([distinct.index(k) for k in mixed], jnp.int32).reshape(R, S))
      weights.append(w_run)
      graphdefs.append(g_run)
      branches.append(b_run)

    residual = carry[0] if isinstance(carry, tuple) else carry
    B, T = residual.shape[:2]
    carry_batched = pipeline.batched_like(carry, B, T)
    arg_leaves, arg_def = jax.tree.flatten(args)
    arg_batched = [bool(f) for f in jax.tree.leaves(pipeline.batched_like(arg_leaves, B, T))]
    micro = [pipeline.split(a, M) for a, f in zip(arg_leaves, arg_batched) if f]
    xs_batched = None if xs is None else pipeline.batched_like(xs, B, T, axis=1)
    xs_staged = None if xs is None else jax.tree.map(
        lambda a, f: (pipeline.split(a.reshape(R, S, Lv, *a.shape[1:]), M, axis=3) if f else
                      a.reshape(R, S, Lv, *a.shape[1:])), xs, xs_batched)
    policy = self.remat_policy

    def stage_fn(per_stage, micro_m, c, mb):
      ws, branch, xs_v = per_stage
      it = iter(micro_m)
      args_m = jax.tree.unflatten(arg_def, [next(it) if f else a
                                            for a, f in zip(arg_leaves, arg_batched)])
      if xs_v is not None:
        xs_v = jax.tree.map(lambda a, f: jax.lax.dynamic_index_in_dim(a, mb, 1, keepdims=False)
                            if f else a, xs_v, xs_batched)
      for run, w_run, g_run, b_run in zip(plan, ws, graphdefs, branch):
        steps = []
        for g_m, b in zip(g_run, b_run):
          calls = [remat(lambda s, c_, x, g=g: _call(g, s, c_, args_m, x), policy,
                         prevent_cse=False) for g in g_m]
          if len(calls) == 1:
            steps.append(lambda s, c_, x, f=calls[0]: f(s[0], c_, x))
          else:
            branches_m = [lambda s, c_, x, f=f, d=d: f(s[d], c_, x) for d, f in enumerate(calls)]
            steps.append(lambda s, c_, x, b=b, fs=branches_m: jax.lax.switch(b, fs, s, c_, x))

        def body(c_, inp, steps=steps):
          states_i, xs_i = inp
          for m, step in enumerate(steps):
            c_ = step(states_i[m], c_, _at(xs_i, m))
          return c_, None

        c, _ = jax.lax.scan(body, c, (w_run, _run_xs(xs_v, run)), unroll=SCAN_UNROLL)
      return c

    return pipeline.run(schedule, stage_fn, (weights, branches, xs_staged), carry, carry_batched,
                        micro)

  # ---- under an inspection probe (module docstring) ----------------------------------------------
  def _probed(self, probe: sites.Probe, carry, args: tuple, xs, method: str | None):
    def framed(g, index, layers, wanted, stride=0):
      """Layer call `g` in a probe frame: layer `index` (+ `stride` x the scan's repeat `r`)."""
      def run(s, c, x, r=None):
        i = index if r is None else index + r * stride
        with probe.frame(i, layers, wanted) as frame:
          c = _with_residual(c, lambda v: sites.site("resid_pre", v))
          c = _call(g, s, c, args, x, method)
          c = _with_residual(c, lambda v: sites.site("resid_post", v))
        return c, frame.captured
      return run

    if not self.scan:
      for i, layer in enumerate(self.layers):
        graphdef, state = nnx.split(layer)
        step = remat(framed(graphdef, i, (i,), probe.wanted((i,))), self.remat_policy)
        carry, captured = step(state, carry, _at(xs, i))
        for base, value in captured.items():
          if i in probe.captured_layers(base):
            probe.store(base, i, value)
      return carry
    for run, members in zip(self.plan, self.runs):
      graphdefs, states = zip(*(nnx.split(m) for m in members))
      p = len(run.block)
      xs_run = _run_xs(xs, run)
      layer_sets = [tuple(run.start + r * p + m for r in range(run.repeats)) for m in range(p)]
      # per member: {captured base: the repeats whose layer was asked for}, the bases in name
      # order: the buffers are built and written in this order, so the program's text (and its
      # persistent-cache key) must not follow a set's order, which changes with the process's
      # hash seed
      keep = [{b: [r for r, i in enumerate(layer_sets[m]) if i in probe.captured_layers(b)]
               for b in sorted(probe.wanted(layer_sets[m]))} for m in range(p)]
      steps = [remat(framed(g, run.start + m, layer_sets[m], frozenset(keep[m]), p),
                     self.remat_policy, prevent_cse=False) for m, g in enumerate(graphdefs)]
      first = jax.tree.map(lambda a: a[0], (list(states), xs_run))
      buffers = []
      for m, step in enumerate(steps):
        shapes = jax.eval_shape(step, first[0][m], carry, _at(first[1], m), 0)[1]
        keep[m] = {b: rows for b, rows in keep[m].items() if b in shapes}   # sites it reaches
        buffers.append({b: jnp.zeros((len(rows), *shapes[b].shape), shapes[b].dtype)
                        for b, rows in keep[m].items()})

      def body(c, inp, steps=steps, keep=keep):
        c, bufs = c
        states_i, xs_i, r = inp
        bufs = [dict(b) for b in bufs]
        for m, step in enumerate(steps):
          c, captured = step(states_i[m], c, _at(xs_i, m), r)
          for b, rows in keep[m].items():
            bufs[m][b] = _store_row(bufs[m][b], captured[b], rows, r)
        return (c, bufs), None

      (carry, buffers), _ = jax.lax.scan(
          body, (carry, buffers), (list(states), xs_run, jnp.arange(run.repeats, dtype=jnp.int32)))
      for m in range(p):
        for b, rows in keep[m].items():
          for k, r in enumerate(rows):
            probe.store(b, run.start + r * p + m, buffers[m][b][k])
    return carry


def _gather(sources: dict, ids: list[int]):
  """The states of layers `ids` stacked on a leading axis (one source's rows in order: as is)."""
  groups: dict = {}
  for pos, i in enumerate(ids):
    key, (_, state), row = sources[i]
    group = groups.setdefault(key, (state, [], []))
    group[1].append(row)
    group[2].append(pos)
  pieces, order = [], []
  for state, rows, positions in groups.values():
    n = jax.tree.leaves(state)[0].shape[0]
    index = np.asarray(rows)
    pieces.append(state if rows == list(range(n)) else
                  jax.tree.map(lambda a, index=index: a[index], state))
    order += positions
  out = pieces[0] if len(pieces) == 1 else jax.tree.map(lambda *a: jnp.concatenate(a), *pieces)
  if order != list(range(len(ids))):
    out = jax.tree.map(lambda a: a[np.argsort(order)], out)
  return out


def _with_residual(carry, fn: Callable):
  """`fn` applied to the residual stream: the carry's first element, or the carry itself."""
  if isinstance(carry, tuple):
    return (fn(carry[0]), *carry[1:])
  return fn(carry)


def _store_row(buf, value, rows: list[int], r):
  """`buf` with `value` in the row of repeat `r` when `r` is one of `rows` (else unchanged)."""
  rows_ = jnp.asarray(rows, jnp.int32)
  slot = jnp.clip(jnp.searchsorted(rows_, r), 0, len(rows) - 1)
  current = jax.lax.dynamic_index_in_dim(buf, slot, keepdims=False)
  new = jnp.where(rows_[slot] == r, value.astype(buf.dtype), current)
  return jax.lax.dynamic_update_index_in_dim(buf, new, slot, 0)
