"""Builds a `Config` from base.yml, an optional model overlay and `key=value` overrides.

Precedence, lowest first: `configs/base.yml` → `configs/models/<model_name>.yml` (after the model
file it names as `base_model`, if any) → command line. Every value is checked against the schema's
type and range here; cross-key checks that need the devices or the model family live in
`MaxText.resolve.config_checks`. Errors are `ConfigError`, which names the key; the
trainer turns them into exit status 2 before anything is compiled.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
from typing import Any, Sequence

import yaml

from MaxText.config import yaml_io
from MaxText.config.schema import (AUTO, AUTO_TOOL_DTYPE, AUTO_TRAINING_DTYPE, KEYS, Config,
                                   in_base_yml)
from MaxText.config.tools import TOOLS


BASE_MODEL = "base_model"   # in a model file: the model file it starts from
# this repository's configs/base.yml (what the tools start from)
BASE_YML = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "configs", "base.yml")


class ConfigError(ValueError):
  """A bad config key or value. The message names the key."""


def _read_yaml(path: str) -> dict[str, Any]:
  if not os.path.isfile(path):
    raise ConfigError(f"config file '{path}' does not exist")
  with open(path, encoding="utf-8") as f:
    try:
      data = yaml_io.safe_load(f)
    except yaml.YAMLError as e:
      raise ConfigError(f"config file '{path}' is not valid YAML: {e}") from None
  if data is None:
    return {}
  if not isinstance(data, dict):
    raise ConfigError(f"config file '{path}' must hold a mapping of key: value")
  return data


def _with_base(path: str) -> dict[str, Any]:
  """A config file's keys; a file with `base_config: NAME` (e.g. configs/sft.yml) holds only the
  keys it changes in NAME (a full config next to it)."""
  raw = _read_yaml(path)
  if "base_config" not in raw:
    return raw
  overlay = dict(raw)
  parent = os.path.join(os.path.dirname(path), str(overlay.pop("base_config")))
  if os.path.abspath(parent) == os.path.abspath(path):
    raise ConfigError(f"config file '{path}' names itself as its base_config")
  return {**_read_yaml(parent), **overlay}


def _unknown_key(key: str, where: str) -> ConfigError:
  close = difflib.get_close_matches(key, KEYS.keys(), n=3, cutoff=0.6)
  hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
  return ConfigError(f"unknown config key '{key}' ({where}){hint}")


def coerce(key: str, value: Any, *, from_text: bool = False) -> Any:
  """Returns `value` as the schema type of `key`, or raises ConfigError naming the key."""
  kind = KEYS[key].type
  if from_text and KEYS[key].repeat:
    value = _str_items(key, value)
  elif from_text and kind is not str:
    try:
      value = yaml_io.safe_load(value) if value != "" else ""
    except yaml.YAMLError:
      raise ConfigError(f"{key}={value!r}: cannot parse the value") from None
    if kind is list and KEYS[key].items in (int, float) and not isinstance(value, list):
      value = _bare_list(key, value)
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
    items = KEYS[key].items
    for v in value:
      if items is not None and (not isinstance(v, items) or isinstance(v, bool) != (items is bool)):
        raise ConfigError(f"{key}={value!r}: expected a list of {items.__name__}, got {v!r}")
  _check_range(key, value)
  return value


def _bare_list(key: str, value: Any) -> list:
  """A list of numbers given on the command line without brackets: `prompt_ids=1,5,9` (split at
  commas), `mlp_only_layers=3` (one item), `mlp_only_layers=` (empty)."""
  if value == "" or value is None:
    return []
  if not isinstance(value, str):
    return [value]
  try:
    return [yaml_io.safe_load(v) for v in value.split(",")]
  except yaml.YAMLError:
    raise ConfigError(f"{key}={value!r}: cannot parse the value") from None


def _str_items(key: str, text: str) -> list:
  """A `repeat` key's command-line text: a YAML list (`image='["a.png", "b.png"]'`), else the text
  as its one item (`image=chart.png`; "" is the empty list)."""
  if not text.lstrip().startswith("["):
    return [text] if text else []
  try:
    value = yaml_io.safe_load(text)
  except yaml.YAMLError:
    raise ConfigError(f"{key}={text!r}: cannot parse the value") from None
  if not isinstance(value, list):
    raise ConfigError(f"{key}={text!r}: expected a list")
  return value


def _check_range(key: str, value: Any) -> None:
  spec = KEYS[key]
  if spec.choices is not None and value not in spec.choices:
    raise ConfigError(f"{key}={value!r}: must be one of {', '.join(map(repr, spec.choices))}")
  if spec.min is not None and value < spec.min:
    raise ConfigError(f"{key}={value!r}: must be >= {spec.min}")
  if spec.max is not None and value > spec.max:
    raise ConfigError(f"{key}={value!r}: must be <= {spec.max}")
  if spec.gt is not None and value <= spec.gt:
    raise ConfigError(f"{key}={value!r}: must be > {spec.gt}")


def parse_overrides(args: Sequence[str]) -> dict[str, str]:
  """`["a=1", "b=x"]` → `{"a": "1", "b": "x"}`; a key given twice with different values is refused,
  but for a `repeat` key, whose values are collected in order (`image=a.png image=b.png`)."""
  out: dict[str, str] = {}
  for arg in args:
    if "=" not in arg:
      raise ConfigError(f"argument '{arg}' is not key=value")
    key, value = arg.split("=", 1)
    key = key.strip()
    if key not in KEYS:
      raise _unknown_key(key, "command line")
    if key in out and KEYS[key].repeat:
      value = json.dumps(_str_items(key, out[key]) + _str_items(key, value))
    elif key in out and out[key] != value:
      raise ConfigError(f"{key} is given twice with different values: {out[key]!r} and {value!r}")
    out[key] = value
  return out


def models_dir(base_yml: str) -> str:
  return os.path.join(os.path.dirname(os.path.abspath(base_yml)), "models")


def model_overlay(directory: str, name: str, chain: tuple[str, ...] = ()) -> dict[str, tuple]:
  """The keys of `<directory>/<name>.yml` as {key: (value, file)}. A model file may start from
  another one with `base_model: <name>` (its keys first, then the file's own): a published alias
  (`gemma4` = `gemma4-e2b`) or a variant that changes a few keys is a reference, not a copy."""
  where = f" (base_model of {chain[-1]}.yml)" if chain else ""
  if not name or name.startswith(".") or any(c in name for c in "/\\\0"):
    raise ConfigError(f"model_name={name!r}{where}: must name a file of {directory} "
                      "(without .yml; no path separators)")
  path = os.path.join(directory, f"{name}.yml")
  if not os.path.isfile(path):
    known = sorted(f[:-4] for f in os.listdir(directory) if f.endswith(".yml")) \
        if os.path.isdir(directory) else []
    raise ConfigError(f"model_name='{name}'{where}: no file {path} (known: default, "
                      f"{', '.join(known)})")
  if name in chain:
    raise ConfigError(f"{path}: base_model loops ({' -> '.join((*chain, name))})")
  raw = _read_yaml(path)
  base = raw.pop(BASE_MODEL, None)
  out = {} if base is None else model_overlay(directory, coerce("model_name", base),
                                              (*chain, name))
  for key, value in raw.items():
    if key not in KEYS:
      raise _unknown_key(key, path)
    if key == "model_name":
      raise ConfigError(f"{path} must not set model_name")
    out[key] = (value, path)
  return out


def resolve_dtype(cfg: Config, *, training: bool) -> Config:
  """`dtype=auto` made concrete: bfloat16 compute for a training run (fp32 master weights unless
  weight_dtype says otherwise; benchmarks/RESULTS.md: the default run's measured speed), float32
  for the tools that compare against a reference (decoding, evaluation, conversions, inspection:
  their Hugging Face parity is exact only in fp32). A set dtype is kept as it is. Then
  `matmul_precision=auto` for that dtype (`resolve_precision`)."""
  if cfg.dtype == AUTO:
    cfg = dataclasses.replace(cfg, dtype=AUTO_TRAINING_DTYPE if training else AUTO_TOOL_DTYPE)
  if cfg.remat_policy == AUTO and not training:   # a training run's Trainer picks it by memory
    cfg = dataclasses.replace(cfg, remat_policy="full")
  if cfg.matmul_precision == AUTO:
    cfg = dataclasses.replace(cfg, matmul_precision=resolve_precision(AUTO, cfg.dtype))
  return cfg


def resolve_precision(matmul_precision: str, dtype: str) -> str:
  """`matmul_precision=auto` made concrete for compute dtype `dtype`: highest for float32 (a
  float32 matmul in float32 on every platform: on TPU the default runs it in bf16 passes), else
  default (MaxText's matmul_precision default). A set value is kept."""
  if matmul_precision != AUTO:
    return matmul_precision
  return "highest" if dtype == "float32" else "default"


def unread_keys(cfg: Config, tool: str, model_keys: frozenset[str] = frozenset()) -> list[str]:
  """The keys `cfg` holds away from their schema default that `tool` does not read, but for
  `model_keys`: those the model file set (it describes the model, e.g. the balancing weight its
  training uses, whichever program runs it)."""
  if tool not in TOOLS:
    raise ValueError(f"unknown tool {tool!r} (MaxText/config/tools.py)")
  return [k for k, spec in KEYS.items()
          if tool not in spec.tools and k not in model_keys and getattr(cfg, k) != spec.default]


def check_read_by(cfg: Config, tool: str, model_keys: frozenset[str] = frozenset()) -> None:
  """ConfigError naming each key `cfg` sets away from its default (on the command line or in the
  config file; `model_keys` as in `unread_keys`) that `tool` does not read, and the programs that
  read it: a setting is never silently ignored."""
  problems = []
  for k in unread_keys(cfg, tool, model_keys):
    readers = ", ".join(TOOLS[t] for t in TOOLS if t in KEYS[k].tools)
    problems.append(f"{k}={_shown(getattr(cfg, k))}: {TOOLS[tool]} does not read {k} (it is read "
                    f"by {readers}); remove it, or leave it at its default "
                    f"({_shown(KEYS[k].default)})")
  if problems:
    raise ConfigError(" | ".join(problems))


def _shown(value: Any) -> str:
  table = isinstance(value, list) and value and isinstance(value[0], list)
  return "[...]" if table else repr(value)


def load_config(argv: Sequence[str], *, keep_auto: bool = False, tool: str | None = None
                ) -> Config:
  """`argv` = [path/to/base.yml, key=value, ...] (without the program name). `dtype=auto` is
  resolved for the tools (float32, `resolve_dtype`) unless `keep_auto` (the trainer resolves it
  itself, for training). With `tool` (a name of MaxText/config/tools.py), a key set away from its
  default that the tool does not read is refused (`check_read_by`)."""
  if not argv:
    raise ConfigError("usage: train.py configs/base.yml [key=value ...]")
  base_path, overrides = argv[0], parse_overrides(argv[1:])
  raw = _with_base(base_path)
  missing = sorted(k for k in KEYS if k not in raw and in_base_yml(k))   # a plug-in's: defaults
  if missing:
    raise ConfigError(f"{base_path} lacks keys of the schema: {', '.join(missing)}")
  for key in raw:
    if key not in KEYS:
      raise _unknown_key(key, base_path)
  values = {k: coerce(k, v) for k, v in raw.items()}

  model_name = coerce("model_name", overrides["model_name"], from_text=True) \
      if "model_name" in overrides else values["model_name"]
  from_model: set[str] = set()
  if model_name != "default":
    for key, (value, _) in model_overlay(models_dir(base_path), model_name).items():
      values[key] = coerce(key, value)
      from_model.add(key)

  for key, text in overrides.items():
    values[key] = coerce(key, text, from_text=True)
  cfg = Config(**values)
  if tool is not None:
    check_read_by(cfg, tool, frozenset(from_model - set(overrides) - {"model_name"}))
  return cfg if keep_auto else resolve_dtype(cfg, training=False)


def explicit_keys(argv: Sequence[str]) -> set[str]:
  """Keys that `argv` sets beyond base.yml: on the command line or through the model file."""
  overrides = parse_overrides(argv[1:])
  keys = set(overrides)
  model_name = overrides.get("model_name") or _with_base(argv[0]).get("model_name", "default")
  if model_name != "default":
    keys |= set(model_overlay(models_dir(argv[0]), model_name))
  return keys


def replace(cfg: Config, **changes: Any) -> Config:
  """A copy of `cfg` with `changes` coerced and range-checked like command-line values."""
  for key in changes:
    if key not in KEYS:
      raise _unknown_key(key, "replace()")
  return dataclasses.replace(cfg, **{k: coerce(k, v) for k, v in changes.items()})


def to_yaml(cfg: Config) -> str:
  return yaml_io.safe_dump(cfg.as_dict(), sort_keys=False, default_flow_style=None)
