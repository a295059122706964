"""Mesh-independent checksums of arrays, computed where the arrays are.

checksum(x) = sum over elements e of bits(e) * W(e)  (mod 2^64), written as 16 hex digits.
`bits` are the element's raw bits as an unsigned integer (floats bitcast, 8- and 16-bit types
zero-extended, bool 0/1; a 64-bit type is two 32-bit words on a trailing axis). W(e) is the
product over the axes k of per-axis weights w_k(i_k) of the element's index i_k along that axis,
w_k(i) = fmix64(i XOR key_k) | 1 (MurmurHash3's 64-bit finaliser; odd). Properties that matter:

- a sum mod 2^64 does not depend on the order of the additions, so the value is the same whatever
  the sharding or mesh (restore onto another mesh verifies against the same number);
- changing any single element always changes the checksum (its change, below 2^32, times an odd
  weight is never 0 mod 2^64), so every single flipped bit of an array's values is caught;
- several changes cancel only when their weighted sum is 0 mod 2^64: about 2^-63 for damage
  unrelated to the weights; at worst (a change of only the top bit of 32, e.g. two flipped float
  signs) about 2^-32, as the weights are odd;
- it is not cryptographic: it detects corruption, not tampering (the file digests of
  `manifest.py` are SHA-256).

Where it is computed: arrays in host memory (CPU devices, NumPy) are contracted axis by axis with
NumPy on zero-copy views of the shards this process holds — one pass over the values (about 0.8 ns
per element and core here), split over threads — and the processes' sums are added up (XLA:CPU
does not vectorise integer reductions: the per-element hash this replaces took 9-12 times as long
there; benchmarks/checkpoint_faults.py --cost). Arrays on GPU/TPU are checksummed on their
devices in one fused pass (64-bit integers inside that one computation).

`legacy_tree_checksums`: the per-element hash of manifests written before (kind "fmix32"; still
verified) and of `batch_checksum`.
"""
from __future__ import annotations

import concurrent.futures
import functools
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

KIND = "axis-weights64"   # the manifest's name for this checksum
LEGACY_KIND = "fmix32"    # manifests without a "checksum" field
_SEED = 0x9E3779B97F4A7C15
_MASK = 2**64 - 1
_TASK_ELEMENTS = 1 << 22  # a thread's share of a large array


# ---- the weights (one definition for NumPy and jax.numpy) ---------------------------------------
def _fmix64(h):
  h = h ^ (h >> 33)
  h = h * np.uint64(0xFF51AFD7ED558CCD)
  h = h ^ (h >> 33)
  h = h * np.uint64(0xC4CEB9FE1A85EC53)
  return h ^ (h >> 33)


@functools.cache
def _axis_key(axis: int) -> np.uint64:
  with np.errstate(over="ignore"):   # NumPy scalars warn where arrays wrap silently
    return _fmix64(np.uint64((_SEED + axis) & _MASK))


def _axis_weights(index, axis: int):
  """w_axis(index) for a uint64 array of indices (NumPy or jax.numpy)."""
  return _fmix64(index ^ _axis_key(axis)) | np.uint64(1)


# ---- host arrays: NumPy ---------------------------------------------------------------------
def _host_bits(a: np.ndarray) -> np.ndarray:
  """The raw bits of a host array, without a copy (unsigned; 64-bit types as two uint32)."""
  if a.dtype == np.bool_:
    return a.view(np.uint8)
  size = a.dtype.itemsize
  if size == 8:
    return a.view(np.uint32).reshape(*a.shape, 2)
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[size])


def _host_sum(bits: np.ndarray, starts: tuple[int, ...]) -> int:
  """sum bits * W (mod 2^64) of a block whose first element sits at global index `starts`:
  the last axis first (the one pass over the values), then the smaller partial sums."""
  r = bits
  for axis in reversed(range(bits.ndim)):
    index = np.arange(starts[axis], starts[axis] + r.shape[-1], dtype=np.uint64)
    r = np.einsum("...j,j->...", r, _axis_weights(index, axis), dtype=np.uint64)
  return int(r)


def _blocks(bits: np.ndarray, starts: tuple[int, ...]):
  """(block, its starts) along the first axis, about `_TASK_ELEMENTS` each (threads' tasks)."""
  if bits.ndim == 0 or bits.size <= _TASK_ELEMENTS:
    yield bits, starts
    return
  rows = max(1, _TASK_ELEMENTS // (bits.size // bits.shape[0]))
  for i in range(0, bits.shape[0], rows):
    yield bits[i:i + rows], (starts[0] + i, *starts[1:])


def _host_pieces(x: Any):
  """(bits, global starts) of every piece of `x` this process counts: each distinct shard once
  over all processes (replica 0), or the whole of a NumPy array."""
  if not isinstance(x, jax.Array):
    bits = _host_bits(np.asarray(x))
    yield bits, (0,) * bits.ndim
    return
  for shard in x.addressable_shards:
    if shard.replica_id != 0:
      continue
    bits = _host_bits(np.asarray(shard.data))   # a view of the device buffer (CPU)
    starts = tuple(s.indices(n)[0] for s, n in zip(shard.index, x.shape))
    yield bits, starts + (0,) * (bits.ndim - len(starts))


def _host_sums(leaves: list) -> list[int]:
  """This process's part of each leaf's checksum (NumPy releases the GIL: threads run at once)."""
  tasks = [(i, block) for i, leaf in enumerate(leaves) for piece in _host_pieces(leaf)
           for block in _blocks(*piece)]
  sums = [0] * len(leaves)
  with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1,
                                             thread_name_prefix="checksum") as pool:
    for (i, _), part in zip(tasks, pool.map(lambda t: _host_sum(*t[1]), tasks)):
      sums[i] = (sums[i] + part) & _MASK
  return sums


def _over_processes(sums: list[int]) -> list[int]:
  """Each leaf's sums added over the processes (every process calls it, in the same order)."""
  if jax.process_count() == 1 or not sums:
    return sums
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  words = np.array([[s & 0xFFFFFFFF, s >> 32] for s in sums], np.uint32)   # no 64-bit in JAX
  gathered = np.asarray(multihost_utils.process_allgather(words)).astype(np.uint64)
  return [sum(int(lo) | int(hi) << 32 for lo, hi in gathered[:, i]) & _MASK
          for i in range(len(sums))]


def _on_host(x: Any) -> bool:
  return not isinstance(x, jax.Array) or all(d.platform == "cpu" for d in x.sharding.device_set)


# ---- device arrays: one fused pass ----------------------------------------------------------------
def _element_bits(x: jax.Array) -> jax.Array:
  """The raw bits of every element as uint32 (a trailing axis for types wider than 32 bits)."""
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  size = np.dtype(x.dtype).itemsize
  if size == 4:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  if size < 4:
    unsigned = {1: jnp.uint8, 2: jnp.uint16}[size]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
  return jax.lax.bitcast_convert_type(x, jnp.uint32)  # wider: shape (..., size // 4)


def _device_sum(x: jax.Array) -> jax.Array:
  bits = _element_bits(x).astype(jnp.uint64)
  weights = jnp.ones((), jnp.uint64)
  for axis in range(bits.ndim):
    weights = weights * _axis_weights(
        jax.lax.broadcasted_iota(jnp.uint64, bits.shape, axis), axis)
  return jnp.sum(bits * weights, dtype=jnp.uint64)


@jax.jit
def _device_sums(leaves: list) -> list:
  return [_device_sum(x) for x in leaves]


def _start_device(leaves: list) -> Callable[[], list[int]]:
  with jax.enable_x64(True):
    pending = _device_sums(leaves)
  return lambda: [int(v) for v in jax.device_get(pending)]


# ---- the API ------------------------------------------------------------------------------------
def path_name(keypath: tuple) -> str:
  """A tree path as "a/b/0/c" (dict keys, attribute names and sequence indices)."""
  parts = []
  for k in keypath:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return "/".join(parts)


def tree_checksums(tree: Any, prefix: str = "") -> dict[str, str]:
  """{"<prefix>/<path>": 16 hex digits} for every array leaf of `tree` (all processes call it)."""
  return start_tree_checksums(tree, prefix)()


def start_tree_checksums(tree: Any, prefix: str = "", *, background: bool = False
                         ) -> Callable[[], dict[str, str]]:
  """Starts the checksums and returns a function that gives `tree_checksums`' dict; every process
  calls this, in the same order as the others.

  Host arrays are summed before this returns (and added up over the processes), so no view of
  their buffers outlives it; with `background`, on threads instead — then the arrays must not
  change until the function has returned, and with several processes the function must run on
  the main thread of each, in the same order (it adds the sums up with a collective). Device
  arrays' sums are dispatched, and fetched by the function (on any thread)."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  names = [f"{prefix}/{path_name(p)}" if prefix else path_name(p) for p, _ in flat]
  host = [i for i, (_, leaf) in enumerate(flat) if _on_host(leaf)]
  device = [i for i, (_, leaf) in enumerate(flat) if not _on_host(leaf)]
  host_sums = _start_host([flat[i][1] for i in host], background)
  fetch = _start_device([flat[i][1] for i in device]) if device else list

  def finish() -> dict[str, str]:
    sums = dict(zip(host, host_sums()))
    sums.update(zip(device, fetch()))
    return {names[i]: f"{sums[i]:016x}" for i in range(len(flat))}
  return finish


def _start_host(leaves: list, background: bool) -> Callable[[], list[int]]:
  """The host leaves' sums over all processes: computed now, or on a thread (the returned
  function joins it and adds the processes' sums up)."""
  if not background:
    sums = _over_processes(_host_sums(leaves))
    return lambda: sums
  pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checksums")
  future = pool.submit(_host_sums, leaves)
  pool.shutdown(wait=False)   # its thread ends with the task
  return lambda: _over_processes(future.result())


# ---- the checksum of manifests written before (kind "fmix32") -----------------------------------
_LEGACY_SEEDS = (0x9E3779B9, 0x7F4A7C15)


def _fmix32(h: jax.Array) -> jax.Array:
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _flat_index(shape: tuple[int, ...]) -> jax.Array:
  """Row-major element index mod 2^32 (built from per-axis iotas; fused, never materialised)."""
  index = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(len(shape))):
    iota = jax.lax.broadcasted_iota(jnp.uint32, shape, axis)
    index = index + iota * jnp.uint32(stride % 2**32)
    stride *= shape[axis]
  return index


def _legacy_checksum(x: jax.Array) -> jax.Array:
  """sum over elements of fmix32(bits XOR fmix32(row-major index + seed)) mod 2^32, two seeds."""
  bits = _element_bits(x)
  index = _flat_index(bits.shape)
  lanes = [jnp.sum(_fmix32(bits ^ _fmix32(index + jnp.uint32(seed))), dtype=jnp.uint32)
           for seed in _LEGACY_SEEDS]
  return jnp.stack(lanes)


@jax.jit
def _legacy_tree(tree: Any) -> Any:
  return jax.tree.map(_legacy_checksum, tree)


def legacy_tree_checksums(tree: Any, prefix: str = "") -> dict[str, str]:
  """`tree_checksums` with the hash of manifests of kind "fmix32" (all processes call it)."""
  out = {}
  for keypath, value in jax.tree_util.tree_flatten_with_path(jax.device_get(_legacy_tree(tree)))[0]:
    name = path_name(keypath)
    lanes = np.asarray(value, dtype=np.uint64)
    out[f"{prefix}/{name}" if prefix else name] = f"{int(lanes[0]):08x}{int(lanes[1]):08x}"
  return out


@jax.jit
def batch_checksum(batch: dict[str, jax.Array]) -> jax.Array:
  """One uint32 for a whole batch dict (first lane of each array's legacy checksum, summed)."""
  return sum((_legacy_checksum(batch[k])[0] for k in sorted(batch)), jnp.uint32(0))
