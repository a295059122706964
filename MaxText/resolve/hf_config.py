"""The config.json of a Hugging Face folder (`hf_path`), read and checked with the standard library
alone: train.py refuses a folder without one before jax is imported (from_hf.py reads it again
when the run adopts the folder's architecture)."""
from __future__ import annotations

import json

from MaxText.config.load import ConfigError
from MaxText.storage import paths


def read_hf_config(folder: str) -> dict:
  path = paths.join(folder, "config.json")
  if not paths.isfile(path):
    raise ConfigError(f"hf_path: {path} does not exist")
  try:
    config = json.loads(paths.read_bytes(path))
  except json.JSONDecodeError as e:
    raise ConfigError(f"hf_path: {path} is not valid JSON: {e}") from None
  if "auto_map" in config:
    raise ConfigError(f"hf_path: {path} has 'auto_map' (custom remote code); refusing to load it")
  if "model_type" not in config:
    raise ConfigError(f"hf_path: {path} has no 'model_type'")
  return config
