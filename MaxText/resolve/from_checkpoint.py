"""With `load_parameters_path`, the architecture comes from the checkpoint's stored config.

Architecture keys (the schema's `arch` keys) the user did not set (on the command line or through
`model_name`'s file) are taken from the checkpoint; one the user set to a different value is an
error naming both values. The schema's `carried` training settings (the load-balancing weight) are
taken the same way, but may be set to another value.

A quantized checkpoint (weight_bits > 0) must hold every module this version quantizes as integer
levels + scales (`check_quantized_layout`): one written before a module kind was quantized (MoE
checkpoints quantized before the routed experts were) is refused with exit 4 and what to do.
"""
from __future__ import annotations

from typing import Sequence

from MaxText.checkpoint.errors import CheckpointError
from MaxText.checkpoint.manager import read_meta, stored_param_names
from MaxText.config.load import ConfigError, explicit_keys, replace, resolve_dtype
from MaxText.config.schema import ARCHITECTURE_KEYS, CARRIED_KEYS, Config
from MaxText.layers import quant
from MaxText.models.model_config import ModelConfig
from MaxText.models.registry import make_model_def


def adopt_checkpoint_architecture(cfg: Config, argv: Sequence[str]) -> Config:
  try:
    saved = read_meta(cfg.load_parameters_path)["config"]
  except FileNotFoundError as e:
    raise ConfigError(f"load_parameters_path: {e}") from None
  explicit = explicit_keys(argv)
  changes = {}
  for key in sorted(ARCHITECTURE_KEYS & set(saved)):
    if saved[key] == getattr(cfg, key):
      continue
    if key in explicit:
      raise ConfigError(f"{key}={getattr(cfg, key)!r} disagrees with the checkpoint at "
                        f"load_parameters_path ({key}={saved[key]!r})")
    changes[key] = saved[key]
  changes.update({k: saved[k] for k in CARRIED_KEYS & set(saved) - explicit
                  if saved[k] != getattr(cfg, k)})
  cfg = replace(cfg, **changes) if changes else cfg
  check_quantized_layout(cfg, cfg.load_parameters_path)
  return cfg


def check_quantized_layout(cfg: Config, path: str) -> None:
  """CheckpointError (exit 4) when the quantized checkpoint at `path` (its config `cfg`) holds in
  float, without scales, modules this version's integer model quantizes."""
  if not cfg.weight_bits:
    return
  mcfg = ModelConfig.from_config(resolve_dtype(cfg, training=False))   # dtype may still be auto
  modules = quant.kept_float(make_model_def(mcfg).abstract_params, stored_param_names(path))
  if not modules:
    return
  kinds = "|".join(sorted({m.rsplit("/", 1)[-1] for m in modules}))
  raise CheckpointError(
      f"checkpoint '{path}' was quantized (weight_bits={cfg.weight_bits}) by an earlier version "
      f"that kept {kinds} in float: {len(modules)} module(s) hold float weights without scales "
      f"where this version expects integer levels + scales (first: {modules[0]}). Re-quantize "
      f"the float checkpoint it was made from with python -m MaxText.quantize (which now "
      f"quantizes {kinds} too), or with weight_quant_exclude={kinds} added to keep them in float "
      f"as this checkpoint does")
