"""`decoder_block` → model family (MaxText/models/family.py: what generic code knows of one).

`FAMILY_MODULES` (MaxText/models/families.py) is the one table of the families in this repository:
a family is its folder `MaxText/models/<family>/` (whose `family.py` defines `FAMILY`, and whose
`keys.py`, if any, declares the model keys only it reads) plus one line there; the module is
imported the first time the family is asked for. One rule: a folder is one family and holds all
it owns — its model, its checks and every Hugging Face map it lists in `FAMILY.hf_maps` (the
llama family's Llama, Qwen3 and Qwen3-MoE maps are all in `llama/`); a family's folder imports no
other family's (tests/test_layering.py). A family defined elsewhere (a test, a user's
package) calls `register(FAMILY)`, and `unregister(name)` undoes it (`with registered(FAMILY):`
for the span of a block, as the tests do). Generic code reaches families only through this module.
"""
from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from types import ModuleType

from MaxText.config import schema
from MaxText.config.load import ConfigError
from MaxText.metrics.flops import FlopCount, training_flops_per_step
from MaxText.models.families import FAMILY_MODULES
from MaxText.models.family import Family, Problems
from MaxText.models.model_config import ModelConfig
from MaxText.models.model_def import (ModelDef, init_compiler_options, init_params_of, init_traced,
                                      model_def_of)

_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
  """Makes `family` the one behind decoder_block=family.name; its own keys (`family.keys`) join the
  schema (`schema.add_keys`; already there for a family of the table)."""
  if family.keys is not None:
    schema.add_keys(family.name, family.keys)
  _FAMILIES[family.name] = family
  return family


def unregister(name: str) -> Family:
  """Undoes `register`: decoder_block=name no longer finds the family, and the keys it brought
  leave the schema (`schema.remove_keys`; those of a family of the table stay: the family is
  imported again the next time it is asked for). KeyError when none is registered as `name`."""
  family = _FAMILIES.pop(name)
  if name not in FAMILY_MODULES and family.keys is not None:
    schema.remove_keys(name)
  return family


@contextlib.contextmanager
def registered(family: Family) -> Iterator[Family]:
  """`register(family)` for the block; after it the registry and the schema are what they were
  before (the family registered before under that name back, keys the schema had before kept)."""
  before, keys_before = _FAMILIES.get(family.name), schema.family_keys(family.name)
  register(family)
  try:
    yield family
  finally:
    _FAMILIES.pop(family.name, None)
    if keys_before is None and family.name not in FAMILY_MODULES:
      schema.remove_keys(family.name)
    if before is not None:
      _FAMILIES[family.name] = before


def names() -> list[str]:
  return sorted(set(FAMILY_MODULES) | set(_FAMILIES))


def get_family(decoder_block: str) -> Family:
  if decoder_block not in _FAMILIES and decoder_block in FAMILY_MODULES:
    family = importlib.import_module(FAMILY_MODULES[decoder_block]).FAMILY
    if family.name != decoder_block:
      raise ValueError(f"{FAMILY_MODULES[decoder_block]}.FAMILY is named {family.name!r}, "
                       f"registered as {decoder_block!r}")
    register(family)
  if decoder_block not in _FAMILIES:
    raise ConfigError(f"decoder_block='{decoder_block}': unknown model family "
                      f"(known: {', '.join(names())})")
  return _FAMILIES[decoder_block]


def make_model_def(mcfg: ModelConfig, modify=None) -> ModelDef:
  """`modify(model)`: see `model_def.model_def_of`."""
  return model_def_of(get_family(mcfg.decoder_block).build, mcfg, modify)


def init_params(mcfg: ModelConfig, seed: int):
  """The random init of seed `seed`, one program of its own; inside a jitted function (compiled
  with `init_options(mcfg)`), `init_params_traced`."""
  return init_params_of(get_family(mcfg.decoder_block).build, mcfg, seed)


def init_params_traced(mcfg: ModelConfig, seed):
  return init_traced(get_family(mcfg.decoder_block).build, mcfg, seed)


def init_options(mcfg: ModelConfig, platform: str | None = None):
  """The `compiler_options` of a jitted program on `platform` (None: the default device's) that
  calls `init_params_traced` (model_def.py's `init_compiler_options`): the same values as
  `init_params` alone gives there."""
  return init_compiler_options(get_family(mcfg.decoder_block).build, mcfg, platform)


def model_flops(mcfg: ModelConfig, seq_len: int, causal: bool = True) -> FlopCount:
  return get_family(mcfg.decoder_block).flops(mcfg, seq_len, causal)


def training_flops(mcfg: ModelConfig, *, seq_len: int, global_batch: int,
                   causal: bool = True) -> dict:
  """`metrics.flops.training_flops_per_step` of the family's count."""
  return training_flops_per_step(model_flops(mcfg, seq_len, causal), seq_len=seq_len,
                                 global_batch=global_batch)


def check_model(mcfg: ModelConfig, hf_model_type: str = "") -> Problems:
  """The family's refusals (keys it does not implement, its own checks) and, when
  `hf_model_type` is set, that it is one of the family's Hugging Face architectures and that
  architecture can hold this model."""
  family = get_family(mcfg.decoder_block)
  problems = family.problems(mcfg)
  if hf_model_type and not problems:
    if hf_model_type not in family.hf_maps:
      known = ", ".join(family.hf_maps) or "none"
      problems.append(("hf_model_type", f"hf_model_type={hf_model_type!r} is not an architecture "
                       f"of decoder_block={family.name} (its Hugging Face model types: {known})"))
    else:
      try:
        family.hf_maps[hf_model_type].config_to_hf(mcfg)
      except ValueError as e:
        problems.append(("hf_model_type", f"hf_model_type={hf_model_type!r} cannot hold this "
                         f"model: {e}"))
  return problems


def hf_model_type_for(mcfg: ModelConfig, hf_model_type: str = "") -> str:
  """The Hugging Face model_type an export writes: `hf_model_type`, or with "" the first of the
  family's types whose config can hold the model (ValueError when none can)."""
  if hf_model_type:
    return hf_model_type
  family = get_family(mcfg.decoder_block)
  why = []
  for model_type, hf_map in family.hf_maps.items():
    try:
      hf_map.config_to_hf(mcfg)
      return model_type
    except ValueError as e:
      why.append(f"{model_type}: {e}")
  raise ValueError(f"no Hugging Face architecture of decoder_block={family.name} can hold this "
                   f"model ({'; '.join(why) or 'the family has none'})")


def get_hf_map(model_type: str) -> ModuleType:
  """The name map of a Hugging Face model_type, from whichever family declares it."""
  for name in names():
    hf_maps = get_family(name).hf_maps
    if model_type in hf_maps:
      return hf_maps[model_type]
  known = sorted(t for name in names() for t in get_family(name).hf_maps)
  raise ValueError(f"Hugging Face model_type '{model_type}' is not supported "
                   f"(supported: {', '.join(known)})")
