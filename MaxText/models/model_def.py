"""A model's static half and its parameters' shapes, built from a family's constructor: the NNX
graphdef, the abstract parameters (ShapeDtypeStruct, nothing allocated) and their logical axes.
Parameters are plain nested dicts (`nnx.to_pure_dict`). `registry.make_model_def(mcfg)` /
`registry.init_params(mcfg, seed)` pick the constructor from `mcfg.decoder_block`. Its calls trace
the model on `mcfg.hot_path` (MaxText/backend/hot_path.py) and at `mcfg.matmul_precision`
(`jax.default_matmul_precision`: every matmul of the model, its gradient's too, in whichever
program traces it — the train step, the decoding engine, evaluation, inspection)."""
from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx, traverse_util

from MaxText.backend import hot_path
from MaxText.config.load import resolve_precision
from MaxText.layers import lora, quant
from MaxText.models.model_config import ModelConfig

Build = Callable[..., nnx.Module]   # build(mcfg, rngs=nnx.Rngs(...))


Path = tuple[str, ...]


def leaf_paths(tree) -> list[Path]:
  """Each leaf's path of dict keys (or sequence indices, as strings), in `jax.tree.leaves` order."""
  return [tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
          for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


@dataclass(frozen=True)
class Head:
  """An LM head as the losses take it: `head(params, hidden [..., D]) -> fp32 logits [..., V]`,
  and `paths`, the parameters it reads named by path (prefixes in the parameter dict: the
  model's `head_params()`), so a loss takes the gradient of the head's weights alone (and splits
  them over the vocabulary) without looking into the head's computation."""
  fn: Callable[[Any, jax.Array], jax.Array]
  paths: tuple[Path, ...]

  def __call__(self, params, hidden):
    return self.fn(params, hidden)

  def reads(self, params) -> list[bool]:
    """Per leaf of `params` (in `jax.tree.leaves` order): whether it is one of the head's."""
    return [any(path[:len(p)] == p for p in self.paths) for path in leaf_paths(params)]


@dataclass(frozen=True)
class ModelDef:
  """The static half of a model (NNX graphdef) plus the abstract parameters and their logical axes."""
  graphdef: Any
  abstract_params: Any   # pure dict of ShapeDtypeStruct
  logical_axes: Any      # pure dict of tuples of logical names
  hot_path: str = "auto"   # the layers' path when traced (`ModelConfig.hot_path`)
  head_paths: tuple[Path, ...] = ()   # the model's `head_params()`: what its `logits` reads
  # the MTP depths the loss trains (mtp_num_layers when mtp_loss_scale > 0, else 0): the token
  # loss then asks `forward_with_aux` for them (`mtp=True`, MaxText/losses/mtp.py)
  mtp_depths: int = 0
  # a sequence split over the context axis runs in the load-balanced token order (attention=flash:
  # layers/context_parallel.py); the loss permutes the batch (losses/token_loss.py)
  balance_context: bool = False
  matmul_precision: str = "default"   # `ModelConfig.matmul_precision`, resolved
  logits_dtype: str = "float32"   # `ModelConfig.logits_dtype`: the logits `apply` / `head` give

  def traced(self):
    """The context the model is traced in: its hot path and its matmuls' precision."""
    return _Traced(self.hot_path, self.matmul_precision)

  def at_precision(self, fn: Callable) -> Callable:
    """`fn` run at the model's matmul precision: for a gradient of the model (`jax.value_and_grad`
    of a loss), whose backward pass — custom VJP rules included — is traced after the forward
    has left `traced`."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
      with jax.default_matmul_precision(self.matmul_precision):
        return fn(*args, **kwargs)
    return wrapped

  def apply(self, params, *args, **kwargs):
    return self.apply_with_aux(params, *args, **kwargs)[0]

  def apply_with_aux(self, params, *args, **kwargs):
    """(logits, auxiliary outputs, e.g. {"moe_stats": …}): the family's `forward_with_aux`
    (keyword arguments, e.g. a multimodal family's `media`, go to it as they are)."""
    with self.traced():
      logits, aux = nnx.merge(self.graphdef, params).forward_with_aux(*args, **kwargs)
    return self.stored_logits(logits), aux

  def stored_logits(self, logits: jax.Array) -> jax.Array:
    """The logits as the loss reads them (`logits_dtype`): as computed (fp32), or rounded to bf16
    once and kept so — behind an optimisation barrier, since XLA (excess precision allowed) would
    otherwise drop the fp32 → bf16 → fp32 round trip and keep the fp32 array the rounding is there
    to halve."""
    if self.logits_dtype == "float32" or logits.dtype == jnp.dtype(self.logits_dtype):
      return logits
    return jax.lax.optimization_barrier(logits.astype(self.logits_dtype))

  def apply_hidden(self, params, *args, **kwargs):
    """(final-norm hidden state [B, S, D], auxiliary outputs): for a loss that applies the head
    (`head`) chunk by chunk (`losses/chunked.py`); the family's `forward_with_aux(return_hidden=True)`."""
    with self.traced():
      return nnx.merge(self.graphdef, params).forward_with_aux(*args, return_hidden=True,
                                                               **kwargs)

  @functools.cached_property
  def head(self) -> Head:
    """The family's LM head: final-norm hidden states [..., D] → logits [..., V] (fp32, or bf16
    with `logits_dtype=bfloat16`), with the parameters it reads by name (`Head`)."""
    def logits(params, hidden):
      with self.traced():
        return self.stored_logits(nnx.merge(self.graphdef, params).logits(hidden))
    return Head(logits, self.head_paths)


class _Traced(contextlib.ExitStack):
  """`hot_path.use(path)` and `jax.default_matmul_precision(precision)` together."""

  def __init__(self, path: str, precision: str):
    super().__init__()
    self.path, self.precision = path, precision

  def __enter__(self):
    super().__enter__()
    self.enter_context(hot_path.use(self.path))
    self.enter_context(jax.default_matmul_precision(self.precision))
    return self


def _build(build: Build, mcfg: ModelConfig, seed: int | jax.Array,
           modify: Callable[[nnx.Module], Any] | None = None) -> nnx.Module:
  """The family's module; with `lora_rank`, its projections carry adapters (layers/lora.py); with
  `quantization` / `weight_bits`, quantized matmuls (layers/quant.py); then `modify(model)`."""
  with nnx.use_eager_sharding(False):
    rngs = nnx.Rngs(params=seed)
    model = build(mcfg, rngs=rngs)
    if mcfg.lora_rank:
      lora.attach(model, mcfg.lora_rank, mcfg.lora_alpha, mcfg.lora_targets, rngs)
    quant.apply(model, mcfg)
    if modify is not None:
      modify(model)
    return model


def _abstract_parts(abstract_model: nnx.Module):
  """(graphdef, {path: ShapeDtypeStruct}, {path: logical axes}, head paths) of an abstract model
  (flat dicts keyed by path tuples)."""
  graphdef, state = nnx.split(abstract_model)
  shapes, axes = {}, {}
  for path, var in nnx.to_flat_state(state):
    value = var.get_value()
    shapes[path] = jax.ShapeDtypeStruct(value.shape, value.dtype)
    axes[path] = tuple(var.get_metadata().get("logical_axes") or (None,) * len(value.shape))
  head = getattr(abstract_model, "head_params", None)   # a family without `logits` has none
  return graphdef, shapes, axes, tuple(tuple(p) for p in head()) if head is not None else ()


# Building a model's abstract form (nnx.eval_shape of the whole module: every layer's parameters
# created and traced) is costly, and one process asks for the same model many times: every Trainer, decoding engine, conversion and
# the memory pre-flight's presets, `_param_count`. Keyed by (build, mcfg): `ModelConfig` is a
# frozen, hashable dataclass, and a module's construction reads nothing else (the platform aside,
# fixed for the process; sharding rules, hot path and probes are read when it is called, not
# built). What is kept is immutable (the graphdef, ShapeDtypeStructs, tuples) or never handed
# out (the flat dicts: each ModelDef gets nested dicts of its own, `model_def_of`); an exception
# (e.g. lora_targets selecting nothing) is not cached and is raised again by each call.
@functools.lru_cache(maxsize=64)
def _cached_parts(build: Build, mcfg: ModelConfig):
  return _abstract_parts(nnx.eval_shape(lambda: _build(build, mcfg, 0)))


def model_def_of(build: Build, mcfg: ModelConfig,
                 modify: Callable[[nnx.Module], Any] | None = None) -> ModelDef:
  """`modify(model)`, when given, changes the built module before it is split (e.g. calibration
  probes). Each call returns a ModelDef of its own (its dicts new), the same model built once per
  (build, mcfg) without `modify` (`_cached_parts`)."""
  if modify is None:
    graphdef, shapes, axes, head_paths = _cached_parts(build, mcfg)
  else:
    graphdef, shapes, axes, head_paths = _abstract_parts(
        nnx.eval_shape(lambda: _build(build, mcfg, 0, modify)))
  return ModelDef(graphdef, traverse_util.unflatten_dict(shapes),
                  traverse_util.unflatten_dict(axes),
                  hot_path=mcfg.hot_path,
                  matmul_precision=resolve_precision(mcfg.matmul_precision, mcfg.dtype),
                  logits_dtype=mcfg.logits_dtype,
                  mtp_depths=mcfg.mtp_num_layers if mcfg.mtp_loss_scale > 0 else 0,
                  head_paths=head_paths,
                  balance_context=mcfg.attention == "flash")


# Initialisation runs once, and on XLA:CPU LLVM's optimisation of its random-number code costs
# about a second of compile per few parameter arrays, more than running it unoptimised costs for a
# model under this many parameters: such a model's init program compiles unoptimised
# (`init_compiler_options`). Its values are that one program's, whichever way they are asked for
# (`init_params_of`, the trainer's sharded init, a LoRA run's base).
CPU_UNOPTIMISED_INIT_PARAMS = 1 << 24
_UNOPTIMISED = {"xla_backend_optimization_level": 0}


def _param_count(build: Build, mcfg: ModelConfig) -> int:
  """Every parameter array's size, summed (the abstract model `model_def_of` builds, cached)."""
  return sum(int(math.prod(x.shape)) for x in _cached_parts(build, mcfg)[1].values())


# On a TPU the init program's compile is its cost (it runs once, in tens of ms), and most of that
# is the backend's code generation for the element-wise fusions that turn the random bits into
# normals (an inverse erf each): XLA sizes a fusion's window (the tile one loop iteration holds)
# to fill the scoped VMEM, and the code it generates grows with the window — ~3 s of this
# machine's CPU per draw of 16M values or more compiled for a v5e, 3 draws for Qwen3-0.6B. A
# 2 MiB limit keeps the windows small: the same operations per element (the same values: the
# compiled programs differ in their windows only), 0.6B's init program compiled in ~2 s of CPU
# instead of 13-15 (`bash benchmarks/tpu_aot.sh benchmarks/tpu_init.py --aot qwen3-0.6b`), XLA's
# estimate of its run 1.4x (45 -> 62 M cycles). The RngBitGenerator's own scratch is 1 MiB (a
# 512 KiB limit does not compile; under other effort options 2.12 MiB: `with_init_options` then
# compiles with XLA's defaults).
TPU_INIT_OPTIONS = {"xla_tpu_scoped_vmem_limit_kib": 2048}


def with_init_options(make: Callable[[dict[str, Any] | None], Callable], options, *args):
  """`make(options)(*args)`: an init program made (jitted) with `options` and called. Where a TPU
  cannot compile it within `TPU_INIT_OPTIONS`' scoped VMEM (an operation's scratch outgrows the
  limit: a RngBitGenerator of another chip, or under other options, needs more than this one's
  1 MiB), it is made and called with XLA's defaults instead: the same operations, the same values."""
  try:
    return make(options)(*args)
  except jax.errors.JaxRuntimeError as e:
    if not options or not set(TPU_INIT_OPTIONS) & set(options) or "vmem" not in str(e).lower():
      raise
    return make(None)(*args)


def default_platform() -> str:
  """The platform a jitted program without shardings runs on: the default device's
  (`jax.default_device`), else the default backend's."""
  device = jax.config.jax_default_device  # pyright: ignore[reportAttributeAccessIssue]
  if device is None:
    return jax.default_backend()
  return device if isinstance(device, str) else device.platform


def init_compiler_options(build: Build, mcfg: ModelConfig,
                          platform: str | None = None) -> dict[str, Any] | None:
  """XLA compile options for a program that initialises this model's parameters on `platform`
  (None: `default_platform()`; a `jax.jit`'s `compiler_options`): unoptimised for a small model on
  a CPU, small fusion windows on a TPU (`TPU_INIT_OPTIONS`), else the default (None)."""
  platform = platform or default_platform()
  if platform == "cpu" and _param_count(build, mcfg) < CPU_UNOPTIMISED_INIT_PARAMS:
    return _UNOPTIMISED
  if platform == "tpu":
    return dict(TPU_INIT_OPTIONS)
  return None


def init_traced(build: Build, mcfg: ModelConfig, seed) -> Any:
  """The parameters of seed `seed` (an int or a traced int32), to trace inside a jitted program
  (compiled with `init_compiler_options` for `init_params_of`'s values)."""
  # the key nnx.Rngs makes of an int seed, here of the traced one too, of the model's generator
  # (`param_init_rng`, resolved per platform by ModelConfig.from_config)
  impl = None if mcfg.param_init_rng == "auto" else mcfg.param_init_rng
  key = jax.random.key(seed, impl=impl)
  state = nnx.state(_build(build, mcfg, key))
  return _drawn_flat(state, jax.random.fold_in(key, 1))


# Whatever the generator, the normal parameters are cut from a few large draws instead of one draw
# per parameter array: a compiler handles each draw of the per-array program separately (its
# layers' keys split by vmap, an inverse-erf per array). A v5e compiled Qwen3-0.6B's rbg init
# program in 6.9 s per array, 2.1 s flat (tiny: 4.9 -> 0.6 s; benchmarks/tpu_init.py); XLA:CPU a
# tiny model's threefry program in 1.8-6.0 CPU s per array, 0.6-1.8 flat (qwen3-tiny, the default,
# gemma4-tiny). A draw holds at most FLAT_DRAW_ELEMENTS values (1 GiB of float32): the extra
# memory the init program holds is bounded as a per-array draw bounds it.
FLAT_DRAW_ELEMENTS = 1 << 28
# (No optimisation barrier between a draw and its cuts, though one would spare a tiny model's TPU
# compile a relayout of the draw per array: XLA folds `std * sqrt(2) * erfinv(u)`'s two constants
# into one where a draw feeds one array (Qwen3-0.6B's embedding), and a barrier would keep them
# apart: other values.)


def _drawn_flat(state, key) -> dict:
  """`state` as a pure dict, its parameters with `init_std` metadata (layers/linear.py `param`)
  replaced by std × consecutive slices of normal draws of `key` (the per-array draws traced for
  them are then unused, and XLA drops them)."""
  pure = nnx.to_pure_dict(state)
  drawn = [(path, var) for path, var in nnx.to_flat_state(state)
           if var.get_metadata().get("init_std") is not None]
  groups, size = [[]], 0
  for path, var in drawn:
    n = math.prod(var.get_value().shape)
    if groups[-1] and size + n > FLAT_DRAW_ELEMENTS:
      groups.append([])
      size = 0
    groups[-1].append((path, var, n))
    size += n
  for g, group in enumerate(groups):
    if not group:
      continue
    flat = jax.random.normal(jax.random.fold_in(key, g), (sum(n for *_, n in group),), jnp.float32)
    start = 0
    for path, var, n in group:
      value = var.get_value()
      std = var.get_metadata()["init_std"]
      node = pure
      for part in path[:-1]:
        node = node[part]
      node[path[-1]] = (std * flat[start:start + n].reshape(value.shape)).astype(value.dtype)
      start += n
  return pure


@functools.lru_cache(maxsize=None)
def _init_jit(options: tuple[tuple[str, Any], ...]):
  """`init_traced` jitted with these compile options (one per set of options: its traces and
  compiles cached across calls)."""
  return jax.jit(init_traced, static_argnums=(0, 1), compiler_options=dict(options) or None)


def init_params_of(build: Build, mcfg: ModelConfig, seed: int):
  """The parameters of seed `seed`: one jitted program per model, the seed its argument (not one
  small program per operation, as run eagerly). A program of its own (its compile options are
  its own): inside another jitted function, `init_traced`."""
  return with_init_options(lambda options: _init_jit(tuple(sorted((options or {}).items()))),
                           init_compiler_options(build, mcfg), build, mcfg, seed)
