"""With `load_parameters_path`, the architecture comes from the checkpoint's stored config.

Architecture keys (the schema's `arch` keys) the user did not set (on the command line or through
`model_name`'s file) are taken from the checkpoint; one the user set to a different value is an
error naming both values. The schema's `carried` training settings (the load-balancing weight) are
taken the same way, but may be set to another value.
"""
from __future__ import annotations

from typing import Sequence

from MaxText.checkpoint.manager import read_meta
from MaxText.config.load import ConfigError, explicit_keys, replace
from MaxText.config.schema import ARCHITECTURE_KEYS, CARRIED_KEYS, Config


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
  return replace(cfg, **changes) if changes else cfg
