"""A model's random parameters made straight in its int8 decoding form, on the device, one array at
a time: the float model is never held (Gemma 4 E4B's float32 init is ~30 GB, its int8 form ~11 GB
on a 16 GiB chip). What benchmarks/tpu_decode.py --int8-only decodes with.

The parameters are those of the model built per layer (`scan_layers=false`: the layout decoding
restacks a scanned model into with `decode_unroll_layers`, MaxText/decoding/layout.py), or in
the model's own layout, with `weight_bits=8`. Each array the
model's init draws from Normal(0, std) (`init_std`, layers/linear.py `param`) is drawn so here —
in float32 and rounded to its dtype; an array larger than CHUNK values in pieces of whole rows,
written in place — and each quantization target (`quantization/convert.targets`: the decoder's
projections) is drawn in float32 and quantized at once by RTN (`gptq.rtn`, as `python -m
MaxText.quantize method=rtn bits=8` does), each matrix [prod(in), prod(out)] per leading index,
scales per `weight_group_size` rows; with `weight_quant_vocab` each vocabulary table
(`layers/quant_vocab.tables`: the embedding, Gemma's per-layer-input table) is drawn in pieces of
whole rows, each piece quantized by RTN at once (one scale per row, as `convert.quantize_table`)
and written in place — the float table is never held whole. The arrays the init does not draw (norm scales: ones or
zeros) are the init's own values (its program, every draw in it unused). The values are not
`init_params`' (other keys), the distribution is.

`read_bytes`: the bytes of parameters a decoding step of `batch` rows reads — every array whole,
except a vocabulary table that is not the LM head's (an input embedding, Gemma's per-layer input
table) and its scales: of them, the rows of the step's tokens.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util

CHUNK = 1 << 27        # values per draw (512 MiB of float32: a scanned stack of E4B's MLP)
THREADS = 4            # arrays made at once


def per_layer(mcfg, **keys):
  """`mcfg` built per layer (scan_layers=false), with `keys` replaced."""
  return dataclasses.replace(mcfg, scan_layers=False, **keys)


@functools.lru_cache(maxsize=None)
def _draw_program(n: int, options: tuple):
  """n standard normal values (float32) of a key: the one program with random numbers (its
  compile is what costs: an inverse erf), compiled with the init's options (`init_options`)."""
  return jax.jit(lambda key: jax.random.normal(key, (n,), jnp.float32),
                 compiler_options=dict(options) or None)


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _cut(flat, std, *, shape, dtype):
  return (std * flat[:math.prod(shape)].reshape(shape)).astype(dtype)


@functools.partial(jax.jit, static_argnames=("rows",), donate_argnums=0)
def _fill_rows(table, flat, std, start, *, rows):
  part = (std * flat[:rows * math.prod(table.shape[1:])].reshape(rows, *table.shape[1:]))
  return jax.lax.dynamic_update_slice_in_dim(table, part.astype(table.dtype), start, 0)


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _zeros(*, shape, dtype):
  return jnp.zeros(shape, dtype)


@functools.partial(jax.jit, static_argnames=("rows",), donate_argnums=(0, 1))
def _fill_rows_int8(q, scale, flat, std, start, *, rows):
  """Rows start.. of an int8 table and its per-row scales from the weights std x flat: RTN of the
  piece seen as the head's matrix [D, rows], one group (`convert.quantize_table`)."""
  from MaxText.quantization import gptq  # pylint: disable=import-outside-toplevel
  w = std * flat[:rows * q.shape[1]].reshape(rows, q.shape[1])
  q_DR, s_1R = gptq.rtn(w.T, 8, 0)
  return (jax.lax.dynamic_update_slice_in_dim(q, q_DR.T, start, 0),
          jax.lax.dynamic_update_slice_in_dim(scale, s_1R[0].astype(scale.dtype), start, 0))


@functools.partial(jax.jit, static_argnames=("shape", "lead", "in_rank", "group_size",
                                             "scale_dtype"))
def _rtn_int8(flat, std, *, shape, lead, in_rank, group_size, scale_dtype):
  """(int8 levels [*shape], scales [*lead, G, *out]) of the weight std x flat[:size]."""
  from MaxText.quantization import gptq  # pylint: disable=import-outside-toplevel
  w = std * flat[:math.prod(shape)]
  m = math.prod(shape[:lead])
  k = math.prod(shape[lead:lead + in_rank])
  q, s = jax.vmap(lambda w_KN: gptq.rtn(w_KN, 8, group_size))(w.reshape(m, k, -1))
  return q.reshape(shape), s.reshape(*shape[:lead], s.shape[1], *shape[lead + in_rank:]
                                     ).astype(scale_dtype)


class _Draws:
  """Normal draws of one size (the largest array's, at most CHUNK), draw j of array i of the key
  fold_in(fold_in(key, i), j): the same values in whatever order the arrays are made."""

  def __init__(self, key, n: int, options: tuple):
    self.key, self.n = key, n
    self.program = _draw_program(n, options)

  def __call__(self, i: int, j: int = 0):
    return self.program(jax.random.fold_in(jax.random.fold_in(self.key, i), j))

  def table(self, i: int, shape, dtype, std):
    """Normal(0, std) values of `shape` in `dtype` (array i): one draw, or (larger than a draw)
    whole rows per draw written in place."""
    n = math.prod(shape)
    if n <= self.n:
      return _cut(self(i), np.float32(std), shape=tuple(shape), dtype=dtype)
    rows = max(1, self.n // (n // shape[0]))
    if rows * (n // shape[0]) > self.n:
      raise ValueError(f"a row of {shape} holds more than {self.n} values")
    table = _zeros(shape=tuple(shape), dtype=dtype)
    for j, start in enumerate(range(0, shape[0], rows)):
      start = min(start, shape[0] - rows)        # the last piece ends at the table's end
      table = _fill_rows(table, self(i, j), np.float32(std), np.int32(start), rows=rows)
    return table

  def int8_table(self, i: int, shape, std, scale_dtype):
    """(int8 levels [V, D], scales [V]) of the Normal(0, std) table `table(i, shape, ...)` would
    draw (the same draws), quantized per row piece by piece."""
    v, d = shape
    rows = min(v, max(1, self.n // d))
    if rows * d > self.n:
      raise ValueError(f"a row of {shape} holds more than {self.n} values")
    q, scale = _zeros(shape=tuple(shape), dtype=jnp.int8), _zeros(shape=(v,), dtype=scale_dtype)
    for j, start in enumerate(range(0, v, rows)):
      start = min(start, v - rows)        # the last piece ends at the table's end
      q, scale = _fill_rows_int8(q, scale, self(i, j), np.float32(std), np.int32(start),
                                 rows=rows)
    return q, scale


def _layout(model, exclude: str, vocab: bool = False) -> tuple[dict, dict, dict]:
  """({path: (shape, init_std or None)} of a built model's parameters, {kernel path: (scale
  path, in rank, lead rank)} of its quantization targets (`convert.targets`' choice), {table path:
  scale path} of its int8 vocabulary tables (with `vocab`))."""
  from MaxText.layers import quant, quant_experts, quant_vocab  # pylint: disable=import-outside-toplevel
  arrays = {tuple(map(str, path)): (tuple(var.get_value().shape),
                                    var.get_metadata().get("init_std"))
            for path, var in nnx.to_flat_state(nnx.state(model))}
  tgts = {}
  for name, dense in quant.targets(model, exclude, vocab):
    kernel = (*name.split("/"), "kernel")
    lead = len(arrays[kernel][0]) - dense.in_rank - dense.out_rank
    tgts[kernel] = ((*name.split("/"), "kernel_scale"), dense.in_rank, lead)
  for name, _ in quant_experts.targets(model, exclude):
    for w in quant_experts.WEIGHTS:
      kernel = (*name.split("/"), w)
      tgts[kernel] = ((*name.split("/"), f"{w}_scale"), 1, len(arrays[kernel][0]) - 2)
  tables = {(name,): (name + quant_vocab.SCALE,)
            for name in (quant_vocab.tables(model, exclude) if vocab else ())}
  return arrays, tgts, tables


def params(mcfg, seed: int = 0, layers: bool = True) -> tuple[Any, int]:
  """(the int8 parameters of `mcfg` (a ModelConfig with weight_bits=8) as device arrays on the
  default device — per layer (`layers`), else in the model's own layout: a scanned stack's
  matrices quantized one by one — the float model's parameter count)."""
  from MaxText.models.registry import get_family, init_options, make_model_def  # pylint: disable=import-outside-toplevel
  if mcfg.weight_bits != 8:
    raise ValueError(f"int8_init.params makes int8 weights; weight_bits={mcfg.weight_bits}")
  icfg = per_layer(mcfg) if layers else mcfg
  fcfg = dataclasses.replace(icfg, weight_bits=0, weight_quant_vocab=False)
  want = {tuple(map(str, p)): (p, a) for p, a in
          traverse_util.flatten_dict(make_model_def(icfg).abstract_params).items()}
  build = get_family(fcfg.decoder_block).build
  found = {}

  def fixed_values():
    """The float model built once (traced): its arrays and targets recorded, and the values of
    those the init does not draw (ones, zeros) returned — every draw in it unused (dropped)."""
    model = build(fcfg, rngs=nnx.Rngs(params=seed))
    found["arrays"], found["targets"], found["tables"] = _layout(
        model, mcfg.weight_quant_exclude, mcfg.weight_quant_vocab)
    values = {tuple(map(str, p)): v for p, v in
              traverse_util.flatten_dict(nnx.to_pure_dict(nnx.state(model))).items()}
    return {"/".join(p): values[p] for p, (_, std) in found["arrays"].items() if std is None}

  consts = jax.jit(fixed_values)()
  arrays, tgts, tables = found["arrays"], found["targets"], found["tables"]
  impl = None if fcfg.param_init_rng == "auto" else fcfg.param_init_rng
  sizes = [math.prod(shape) for shape, std in arrays.values() if std is not None]
  draws = _Draws(jax.random.key(seed, impl=impl), min(CHUNK, max(sizes, default=1)),
                 tuple(sorted((init_options(fcfg) or {}).items())))
  out = {}

  def make(i: int, p: tuple) -> None:
    shape, std = arrays[p]
    if p in tables:
      out[p], out[tables[p]] = jax.block_until_ready(draws.int8_table(
          i, shape, std, want[tables[p]][1].dtype))
    elif p in tgts:
      scale, in_rank, lead = tgts[p]
      if math.prod(shape) > draws.n:
        raise ValueError(f"{'/'.join(p)}: {shape} holds more than {draws.n} values")
      out[p], out[scale] = jax.block_until_ready(_rtn_int8(
          draws(i), np.float32(std), shape=shape, lead=lead, in_rank=in_rank,
          group_size=mcfg.weight_group_size, scale_dtype=want[scale][1].dtype))
    elif std is None:
      out[p] = consts["/".join(p)].astype(want[p][1].dtype)
    else:
      out[p] = jax.block_until_ready(draws.table(i, shape, want[p][1].dtype, std))

  # THREADS arrays at a time: their programs (one per shape) compile side by side, and at most
  # THREADS draws (and RTN's temporaries) are held beside the parameters made
  with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
    for f in [pool.submit(make, i, p) for i, p in enumerate(sorted(arrays))]:
      f.result()
  for p, (_, a) in want.items():
    got = out.get(p)
    if got is None or got.shape != a.shape or got.dtype != a.dtype:
      raise ValueError(f"{'/'.join(p)}: made {None if got is None else (got.shape, got.dtype)}, "
                       f"the int8 model's is {(a.shape, a.dtype)}")
  count = sum(math.prod(shape) for shape, _ in arrays.values())
  return traverse_util.unflatten_dict({want[p][0]: v for p, v in out.items()}), count


def read_bytes(model_def, params, batch: int) -> int:
  """The parameter bytes a decoding step of `batch` rows reads (module docstring); `params`:
  arrays or ShapeDtypeStructs of `model_def`'s tree."""
  axes = traverse_util.flatten_dict(model_def.logical_axes)
  total = 0
  for path, a in traverse_util.flatten_dict(params).items():
    nbytes = math.prod(a.shape) * np.dtype(a.dtype).itemsize
    key = tuple(map(str, path))
    head = any(key[:len(h)] == tuple(h) for h in model_def.head_paths)
    if axes[path] and axes[path][0] == "vocab" and not head:
      nbytes = min(nbytes, batch * nbytes // a.shape[0])     # the step's tokens' rows
    total += nbytes
  return total
