"""The decoding cache of a model, as its family declares it (`Family.decode_cache`, the kinds of
MaxText/layers/kv_cache.py): array shapes for a batch and cache length, their shardings from the
logical-axis rules (batch over the data axes, kv heads over tensor, like the activations), an
empty cache built inside a compiled program, and its size in bytes. Nothing here knows a family
or a cache kind."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from MaxText.layers.kv_cache import ArraySpec, CacheGroup
from MaxText.models.model_config import ModelConfig
from MaxText.models.registry import get_family
from MaxText.sharding.rules import Rules, logical_to_spec

ACCELERATORS = ("gpu", "cuda", "rocm", "tpu")
Specs = dict[str, dict[str, ArraySpec]]


def cache_dtype(name: str, compute_dtype: str, platform: str) -> jnp.dtype:
  """The `cache_dtype` key: auto is bfloat16 on accelerators, else the compute dtype."""
  if name == "auto":
    return jnp.dtype(jnp.bfloat16 if platform in ACCELERATORS else compute_dtype)
  return jnp.dtype(name)


def groups(mcfg: ModelConfig) -> dict[str, CacheGroup]:
  """The family's cache groups (ValueError when the family does not decode)."""
  family = get_family(mcfg.decoder_block)
  if family.decode_cache is None:
    raise ValueError(f"decoder_block={family.name}: this model family does not implement decoding "
                     "(its Family has no decode_cache)")
  return dict(family.decode_cache(mcfg))


def specs(mcfg: ModelConfig, batch: int, max_len: int, dtype: Any) -> Specs:
  """{group: {array: ArraySpec}} with each group's "layers" axis in front."""
  return {name: {k: ArraySpec((g.layers, *a.shape), a.dtype, ("layers", *a.logical_axes), a.fill)
                 for k, a in g.kind.arrays(batch, max_len, dtype).items()}
          for name, g in groups(mcfg).items()}


def constrain_cache(cache: dict, cache_specs: Specs, mesh: Mesh, rules: Rules) -> dict:
  """`cache` (arrays of `cache_specs`' logical axes, any shapes) pinned to its shardings."""
  return {name: {k: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(
      cache_specs[name][k].logical_axes, x.shape, rules, mesh))) for k, x in arrays.items()}
          for name, arrays in cache.items()}


def empty(cache_specs: Specs) -> dict:
  """The empty cache (call inside jit, with the shardings as a constraint)."""
  return {name: {k: jnp.full(a.shape, a.fill, a.dtype) for k, a in arrays.items()}
          for name, arrays in cache_specs.items()}


def widen(mcfg: ModelConfig, cache: dict, extra: int, starts_B) -> dict:
  """`cache` ready for a prompt piece of up to `extra` tokens beginning at `starts_B`: each group
  through its kind's `widen` where it has one (a ring: `extra` more slots, MaxText/layers/
  kv_cache.py), else as it is."""
  kinds = {name: g.kind for name, g in groups(mcfg).items()}
  return {name: (kinds[name].widen(arrays, extra, starts_B) if hasattr(kinds[name], "widen")
                 else arrays) for name, arrays in cache.items()}


def narrow(mcfg: ModelConfig, cache: dict, like: Specs) -> dict:
  """`cache` after a piece, back in the shapes of `like` (each group through its kind's `narrow`
  where it has one)."""
  kinds = {name: g.kind for name, g in groups(mcfg).items()}
  return {name: (kinds[name].narrow(arrays, like[name]) if hasattr(kinds[name], "narrow")
                 else arrays) for name, arrays in cache.items()}


def verifying(mcfg: ModelConfig, cache: dict, tokens: int) -> dict:
  """`cache` ready for speculative decoding's verification of `tokens` tokens (MaxText/decoding/
  speculative.py): each group through its kind's `verifying` where it has one (a recurrent state:
  room to keep what the tokens would add), else as it is."""
  kinds = {name: g.kind for name, g in groups(mcfg).items()}
  return {name: (kinds[name].verifying(arrays, tokens) if hasattr(kinds[name], "verifying")
                 else arrays) for name, arrays in cache.items()}


def keep_verified(mcfg: ModelConfig, cache: dict, kept_B) -> dict:
  """A `verifying` cache after the verification, holding each row's first `kept_B` of its tokens:
  each group through its kind's `keep_verified` where it has one, else as it is (a kind that rolls
  back by position: the rejected tokens are written over before they are read)."""
  kinds = {name: g.kind for name, g in groups(mcfg).items()}
  return {name: (kinds[name].keep_verified(arrays, kept_B) if hasattr(kinds[name], "keep_verified")
                 else arrays) for name, arrays in cache.items()}


def nbytes(cache_specs: Specs, mesh: Mesh | None = None, rules: Rules | None = None) -> int:
  """The cache's bytes in all, or with `mesh` and `rules` the bytes one device holds (its shard of
  each array, by the shardings `constrain_cache` gives)."""
  if (mesh is None) != (rules is None):
    raise ValueError("cache nbytes: mesh and rules come together")
  total = 0
  for arrays in cache_specs.values():
    for a in arrays.values():
      shape = a.shape if mesh is None or rules is None else NamedSharding(
          mesh, logical_to_spec(a.logical_axes, a.shape, rules, mesh)).shard_shape(a.shape)
      n = 1
      for d in shape:
        n *= d
      total += n * jnp.dtype(a.dtype).itemsize
  return total
