"""LoRA checkpoints: the adapters only, plus a reference to the frozen base they adapt.

A LoRA run saves its trained adapters (and their optimizer state) and, in the checkpoint's `meta`
item, `lora_base`:
    {"path": the base checkpoint's step directory, or "" for a base made by the random init,
     "init_seed": the init's seed (path ""), "fingerprint": a digest of the base's arrays}
The fingerprint is SHA-256 over the base's mesh-independent array checksums
(`checkpoint/checksum.py`), so it is the same on any mesh, host or device. Every reader of a
checkpoint (`load`, `load_host`: resume, fine-tuning, decoding, evaluation, to_huggingface, the
logit check) takes the base from the reference and the adapters from the checkpoint; a base that
changed since (another fingerprint), moved or vanished is a CheckpointError (exit 4) naming both
paths. A LoRA run started from a LoRA checkpoint keeps that checkpoint's base reference; one
started from a base checkpoint references it; one started from the random init references the
seed. A checkpoint without `lora_base` (a plain model, or a LoRA checkpoint written before this
format, holding its base) loads as before.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import jax
import numpy as np

from MaxText.checkpoint.checksum import tree_checksums
from MaxText.checkpoint.errors import CheckpointError
from MaxText.checkpoint.manager import load_params, load_params_host, read_meta, resolve_step_dir
from MaxText.layers import lora
from MaxText.models.model_config import ModelConfig
from MaxText.models.model_def import with_init_options
from MaxText.models.registry import init_options, init_params_traced, make_model_def
from MaxText.storage import paths

META_KEY = "lora_base"


def fingerprint(base: Any) -> str:
  """A digest of the base parameters' values (the same on any mesh, on host or devices)."""
  sums = sorted(tree_checksums(base).items())
  return hashlib.sha256(json.dumps(sums).encode()).hexdigest()


def reference(path: str, seed: int, base: Any) -> dict:
  """The `lora_base` entry of a run whose base is the checkpoint `path` ("" = the random init of
  `seed`) with the values `base`."""
  return {"path": resolve_step_dir(path) if path else "",
          "init_seed": None if path else int(seed), "fingerprint": fingerprint(base)}


def checkpoint_reference(path: str) -> dict | None:
  """The `lora_base` of the checkpoint at `path` (None: it holds all its parameters)."""
  return read_meta(path).get(META_KEY)


def _init_base(mcfg: ModelConfig, seed: int, shardings: Any) -> Any:
  """The random init's base (what a fresh LoRA run trained on), placed per `shardings` (None:
  host NumPy arrays)."""
  make = lambda: lora.split(init_params_traced(mcfg, seed))[1]
  if shardings is None:   # the values the fresh run's init gave (its platform's options)
    return jax.tree.map(np.asarray, with_init_options(
        lambda o: jax.jit(make, compiler_options=o), init_options(mcfg)))
  options = init_options(mcfg, next(iter(jax.tree.leaves(shardings)[0].device_set)).platform)
  return with_init_options(lambda o: jax.jit(make, out_shardings=shardings, compiler_options=o),
                           options)


def base_of(ref: dict, mcfg: ModelConfig, abstract_base: Any, *, verify: bool, source: str,
            host: bool = False) -> Any:
  """The base of `ref`, checked against its fingerprint (CheckpointError: exit 4)."""
  path = ref.get("path") or ""
  try:
    if not path:
      shardings = None if host else jax.tree.map(lambda a: a.sharding, abstract_base)
      base = _init_base(mcfg, int(ref["init_seed"]), shardings)
    elif host:
      base = load_params_host(path, abstract_base)
    else:
      base = load_params(path, abstract_base, verify=verify)
  except (FileNotFoundError, ValueError) as e:
    raise CheckpointError(f"LoRA checkpoint '{source}': its base model '{path}' cannot be loaded "
                          f"({e})") from e
  got = fingerprint(base)
  if got != ref.get("fingerprint"):
    what = f"'{path}'" if path else f"the random init of seed {ref.get('init_seed')}"
    raise CheckpointError(
        f"LoRA checkpoint '{source}' adapts a base model that has changed: {what} now has "
        f"fingerprint {got[:16]}…, the adapters were trained on {str(ref.get('fingerprint'))[:16]}…"
        " (restore that base, or start a new LoRA run from this one)")
  return base


def load(path: str, mcfg: ModelConfig, abstract: Any, *, verify: bool = True) -> Any:
  """The parameters of the checkpoint at `path` placed per `abstract` (ShapeDtypeStructs with
  shardings): a LoRA checkpoint's adapters joined with its referenced base."""
  ref = checkpoint_reference(path)
  if ref is None:
    return load_params(path, abstract, verify=verify)
  adapters_abstract, base_abstract = lora.split(abstract)
  adapters = load_params(path, adapters_abstract, verify=verify)
  return lora.join(adapters, base_of(ref, mcfg, base_abstract, host=False, verify=verify,
                                   source=paths.absolute(path)))


def load_cast(path: str, mcfg: ModelConfig, abstract: Any, *, verify: bool = True) -> Any:
  """`load`, with the checkpoint read in the weight dtype it was saved in (its config's
  weight_dtype; verified as saved; a LoRA checkpoint's base is fingerprinted as saved) and cast
  on the mesh to `abstract`'s dtypes (`mcfg.weight_dtype`), in one program: e.g. a float32
  training checkpoint decoded with weight_dtype=bfloat16. Both copies are held while it casts."""
  saved = read_meta(path)["config"].get("weight_dtype", mcfg.weight_dtype)
  if saved == mcfg.weight_dtype:
    return load(path, mcfg, abstract, verify=verify)
  stored_mcfg = dataclasses.replace(mcfg, weight_dtype=saved)
  stored = jax.tree.map(lambda s, a: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=a.sharding),
                        make_model_def(stored_mcfg).abstract_params, abstract)
  params = load(path, stored_mcfg, stored, verify=verify)
  return cast_params(params, abstract)


def cast_params(params: Any, abstract: Any) -> Any:
  """`params` in `abstract`'s dtypes and shardings (one program; leaves of the same dtype kept)."""
  def cast(tree):
    return jax.tree.map(lambda x, a: x if x.dtype == a.dtype else x.astype(a.dtype), tree, abstract)
  return jax.jit(cast, out_shardings=jax.tree.map(lambda a: a.sharding, abstract))(params)


def load_host(path: str, mcfg: ModelConfig, abstract: Any) -> Any:
  """`load` as host NumPy arrays in the structure of `abstract` (converters, the logit check)."""
  ref = checkpoint_reference(path)
  if ref is None:
    return load_params_host(path, abstract)
  adapters_abstract, base_abstract = lora.split(abstract)
  adapters = load_params_host(path, adapters_abstract)
  return lora.join(adapters, base_of(ref, mcfg, base_abstract, host=True, verify=True,
                                   source=paths.absolute(path)))
