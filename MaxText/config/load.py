"""Builds a `Config` from base.yml, an optional model overlay and `key=value` overrides.

Precedence, lowest first: `configs/base.yml` → `configs/models/<model_name>.yml` → command line.
Every value is checked against the schema's type and range here; cross-key checks that need the
device count live in `MaxText.config.validate`. Errors are `ConfigError`, which names the key; the
trainer turns them into exit status 2 before anything is compiled.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import typing
from typing import Any, Sequence

import yaml

from MaxText.config.schema import FIELDS, Config


class ConfigError(ValueError):
  """A bad config key or value. The message names the key."""


def _read_yaml(path: str) -> dict[str, Any]:
  if not os.path.isfile(path):
    raise ConfigError(f"config file '{path}' does not exist")
  with open(path, encoding="utf-8") as f:
    try:
      data = yaml.safe_load(f)
    except yaml.YAMLError as e:
      raise ConfigError(f"config file '{path}' is not valid YAML: {e}") from None
  if data is None:
    return {}
  if not isinstance(data, dict):
    raise ConfigError(f"config file '{path}' must hold a mapping of key: value")
  return data


def _unknown_key(key: str, where: str) -> ConfigError:
  close = difflib.get_close_matches(key, FIELDS.keys(), n=3, cutoff=0.6)
  hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
  return ConfigError(f"unknown config key '{key}' ({where}){hint}")


def _type_of(key: str) -> type:
  hints = typing.get_type_hints(Config)
  return hints[key]


def coerce(key: str, value: Any, *, from_text: bool = False) -> Any:
  """Returns `value` as the schema type of `key`, or raises ConfigError naming the key."""
  kind = _type_of(key)
  if from_text and kind is not str:
    try:
      value = yaml.safe_load(value) if value != "" else ""
    except yaml.YAMLError:
      raise ConfigError(f"{key}={value!r}: cannot parse the value") from None
  if kind in (int, float) and isinstance(value, str):  # YAML 1.1 reads "1e-2" as a string
    try:
      value = float(value)
    except ValueError:
      pass
  bad = ConfigError(f"{key}={value!r}: expected {kind.__name__}, got {type(value).__name__}")
  if kind is bool:
    if not isinstance(value, bool):
      raise bad
  elif kind is int:
    if isinstance(value, bool):
      raise bad
    if isinstance(value, float) and value.is_integer():
      value = int(value)
    if not isinstance(value, int):
      raise bad
  elif kind is float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise bad
    value = float(value)
    if not math.isfinite(value):
      raise ConfigError(f"{key}={value!r}: must be a finite number")
  elif kind is str:
    if value is None:
      value = ""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      value = str(value)
    if not isinstance(value, str):
      raise bad
  elif kind is list:
    if not isinstance(value, list):
      raise bad
  _check_range(key, value)
  return value


def _check_range(key: str, value: Any) -> None:
  meta = FIELDS[key].metadata
  if meta.get("choices") is not None and value not in meta["choices"]:
    raise ConfigError(f"{key}={value!r}: must be one of {', '.join(map(repr, meta['choices']))}")
  if meta.get("min") is not None and value < meta["min"]:
    raise ConfigError(f"{key}={value!r}: must be >= {meta['min']}")
  if meta.get("max") is not None and value > meta["max"]:
    raise ConfigError(f"{key}={value!r}: must be <= {meta['max']}")
  if meta.get("gt") is not None and value <= meta["gt"]:
    raise ConfigError(f"{key}={value!r}: must be > {meta['gt']}")


def parse_overrides(args: Sequence[str]) -> dict[str, str]:
  """`["a=1", "b=x"]` → `{"a": "1", "b": "x"}`; a key given twice with different values is refused."""
  out: dict[str, str] = {}
  for arg in args:
    if "=" not in arg:
      raise ConfigError(f"argument '{arg}' is not key=value")
    key, value = arg.split("=", 1)
    key = key.strip()
    if key not in FIELDS:
      raise _unknown_key(key, "command line")
    if key in out and out[key] != value:
      raise ConfigError(f"{key} is given twice with different values: {out[key]!r} and {value!r}")
    out[key] = value
  return out


def models_dir(base_yml: str) -> str:
  return os.path.join(os.path.dirname(os.path.abspath(base_yml)), "models")


def load_config(argv: Sequence[str]) -> Config:
  """`argv` = [path/to/base.yml, key=value, ...] (without the program name)."""
  if not argv:
    raise ConfigError("usage: train.py configs/base.yml [key=value ...]")
  base_path, overrides = argv[0], parse_overrides(argv[1:])
  raw = _read_yaml(base_path)
  missing = sorted(set(FIELDS) - set(raw))
  if missing:
    raise ConfigError(f"{base_path} lacks keys of the schema: {', '.join(missing)}")
  for key in raw:
    if key not in FIELDS:
      raise _unknown_key(key, base_path)
  values = {k: coerce(k, v) for k, v in raw.items()}

  model_name = coerce("model_name", overrides["model_name"], from_text=True) \
      if "model_name" in overrides else values["model_name"]
  if model_name != "default":
    if not model_name or model_name.startswith(".") or any(c in model_name for c in "/\\\0"):
      raise ConfigError(f"model_name={model_name!r}: must name a file of {models_dir(base_path)} "
                        "(without .yml; no path separators)")
    path = os.path.join(models_dir(base_path), f"{model_name}.yml")
    if not os.path.isfile(path):
      known = sorted(f[:-4] for f in os.listdir(models_dir(base_path)) if f.endswith(".yml")) \
          if os.path.isdir(models_dir(base_path)) else []
      raise ConfigError(f"model_name='{model_name}': no file {path} (known: default, {', '.join(known)})")
    for key, value in _read_yaml(path).items():
      if key not in FIELDS:
        raise _unknown_key(key, path)
      if key == "model_name":
        raise ConfigError(f"{path} must not set model_name")
      values[key] = coerce(key, value)

  for key, text in overrides.items():
    values[key] = coerce(key, text, from_text=True)
  return Config(**values)


def explicit_keys(argv: Sequence[str]) -> set[str]:
  """Keys that `argv` sets beyond base.yml: on the command line or through the model file."""
  overrides = parse_overrides(argv[1:])
  keys = set(overrides)
  model_name = overrides.get("model_name") or _read_yaml(argv[0]).get("model_name", "default")
  if model_name != "default":
    keys |= set(_read_yaml(os.path.join(models_dir(argv[0]), f"{model_name}.yml")))
  return keys


def replace(cfg: Config, **changes: Any) -> Config:
  """A copy of `cfg` with `changes` coerced and range-checked like command-line values."""
  for key in changes:
    if key not in FIELDS:
      raise _unknown_key(key, "replace()")
  return dataclasses.replace(cfg, **{k: coerce(k, v) for k, v in changes.items()})


def to_yaml(cfg: Config) -> str:
  return yaml.safe_dump(cfg.as_dict(), sort_keys=False, default_flow_style=None)
