"""The config.json of a Hugging Face folder, read and checked with the standard library alone:
train.py refuses an `hf_path` without one before jax is imported, from_hf.py reads it again when
the run adopts the folder's architecture, and the converters and tools read it through
checkpoint_conversion/hf_io.py (each with its own error type around the one check)."""
from __future__ import annotations

import json

from MaxText.config.load import ConfigError
from MaxText.storage import paths


def hf_config_at(path: str) -> dict:
  """The JSON at `path` (local or an object store), refused with a ValueError naming the path when
  it is missing, not JSON, asks for custom remote code (`auto_map`) or names no `model_type`."""
  if not paths.isfile(path):
    raise ValueError(f"{path} does not exist")
  try:
    config = json.loads(paths.read_bytes(path))
  except json.JSONDecodeError as e:
    raise ValueError(f"{path} is not valid JSON: {e}") from None
  if "auto_map" in config:
    raise ValueError(f"{path} has 'auto_map' (custom remote code); refusing to load it")
  if "model_type" not in config:
    raise ValueError(f"{path} has no 'model_type'")
  return config


def read_hf_config(folder: str) -> dict:
  """`folder`'s config.json (`hf_config_at`); ConfigError (exit 2) naming `hf_path`."""
  try:
    return hf_config_at(paths.join(folder, "config.json"))
  except ValueError as e:
    raise ConfigError(f"hf_path: {e}") from None
