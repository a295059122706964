"""`train.py … hf_path=DIR`: the run starts from a Hugging Face folder, with no conversion step.

- The architecture comes from DIR/config.json (the family's `config_from_hf`, and what its map
  reads from the tensor names in the safetensors headers); an architecture key the user set to
  another value is refused naming both, as with load_parameters_path (exit 2); so is a config the
  family cannot hold (`check_model`, in the run's config checks: config_checks.py), before
  anything compiles. Nothing here touches a device (a multi-process run joins after it).
- The tokenizer and chat template come along: without `tokenizer_path`, the folder's tokenizer
  files are the run's (a folder on an object store: copied to a local temporary folder first, the
  tokenizer libraries read local files) and its checkpoints carry them.
- `check_tensors` compares the headers with the model before anything compiles: a tensor the
  model needs that no shard holds, a wrong shape or a tensor with no place exits 4 naming it.
- The parameters are read onto the mesh by each process, its own slices only
  (`resolve/hf_sharded.py`).
"""
from __future__ import annotations

import os
import tempfile
from types import ModuleType
from typing import Iterable, Sequence

from MaxText.config.load import ConfigError, explicit_keys, replace
from MaxText.config.schema import ARCHITECTURE_KEYS, Config
from MaxText.models.model_config import ModelConfig
from MaxText.models.registry import get_hf_map, make_model_def
from MaxText.resolve import hf_sharded
from MaxText.resolve.hf_config import read_hf_config
from MaxText.storage import paths

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json", "added_tokens.json")


def hf_model_map(folder: str) -> tuple[dict, ModuleType]:
  """(the folder's config.json, its family's HF map); ConfigError (exit 2) naming hf_path."""
  hf_config = read_hf_config(folder)
  try:
    return hf_config, get_hf_map(hf_config["model_type"])
  except ValueError as e:
    raise ConfigError(f"hf_path: {e}") from None


def hf_architecture(cfg: Config, argv: Sequence[str],
                    tensor_names: Iterable[str] | None = None) -> Config:
  """`cfg` (the user's config file, then the command line: `load_config(argv)`) with the
  architecture of the folder at `cfg.hf_path`: its config.json (the family's `config_from_hf`)
  and what its map reads from the tensor names (`tensor_names`, else the safetensors headers).
  The config file's architecture keys give way to the folder's; one the command line (or
  `model_name`'s file) sets to another value is refused naming both (exit 2). `hf_path` made
  absolute. What train.py and every tool resolve a folder with (resolve/architecture.py)."""
  if cfg.load_parameters_path:
    raise ConfigError("hf_path and load_parameters_path both set: give one of them")
  folder = paths.absolute(cfg.hf_path)
  hf_config, hf_map = hf_model_map(folder)
  values = {"hf_model_type": hf_config["model_type"], **hf_map.config_from_hf(hf_config)}
  if hasattr(hf_map, "config_from_tensor_names"):
    names = (hf_sharded.SafetensorsFolder(folder).tensors if tensor_names is None
             else tensor_names)
    values.update(hf_map.config_from_tensor_names(names))
  explicit = explicit_keys(argv)
  for key in sorted(set(values) & ARCHITECTURE_KEYS - {"scan_layers"}):
    if key in explicit and values[key] != getattr(cfg, key):
      raise ConfigError(f"{key}={getattr(cfg, key)!r} disagrees with hf_path's config.json "
                        f"({key}={values[key]!r})")
  return replace(cfg, hf_path=folder, **values)


def adopt_hf_architecture(cfg: Config, argv: Sequence[str]) -> Config:
  """A training run's `hf_architecture`, with the folder's tokenizer (module docstring); a folder
  whose map reads whole tensors, or LoRA, refused. ConfigError (exit 2) naming the key or file."""
  if cfg.load_parameters_path:
    raise ConfigError("hf_path and load_parameters_path both set: give one of them")
  hf_config, hf_map = hf_model_map(paths.absolute(cfg.hf_path))
  if not hf_sharded.reads_sharded(hf_map):
    raise ConfigError(f"hf_path: model_type '{hf_config['model_type']}' is read whole tensors at a "
                      f"time (its map has no folder_map); convert it first (python -m "
                      f"MaxText.checkpoint_conversion.to_maxtext) and train with "
                      f"load_parameters_path")
  if cfg.lora_rank:
    raise ConfigError("hf_path with lora_rank: convert the folder first (to_maxtext) and train "
                      "the adapters with load_parameters_path")
  cfg = hf_architecture(cfg, argv)
  if not cfg.tokenizer_path:
    cfg = replace(cfg, tokenizer_path=_local_tokenizer(cfg.hf_path))
  return cfg


def _local_tokenizer(folder: str) -> str:
  """The folder's tokenizer as a local path (a local folder as it is; on an object store its
  tokenizer files copied to a temporary folder), or "" when it has none."""
  present = set(paths.listdir(folder))
  names = [n for n in TOKENIZER_FILES if n in present] + sorted(
      n for n in present if n.endswith(".model"))
  if not names or not ("tokenizer.json" in names or any(n.endswith(".model") for n in names)):
    return ""
  if not paths.is_url(folder):
    return folder if "tokenizer.json" in names else os.path.join(
        folder, next(n for n in names if n.endswith(".model")))
  local = tempfile.mkdtemp(prefix="hf-tokenizer-")
  for n in names:
    paths.copy_file(paths.join(folder, n), os.path.join(local, n))
  return local if "tokenizer.json" in names else os.path.join(
      local, next(n for n in names if n.endswith(".model")))


def check_tensors(cfg: Config) -> hf_sharded.SafetensorsFolder:
  """The folder's headers, checked against the model of `cfg` (dtypes resolved): HFFolderError
  (exit 4) naming a missing, misshapen or extra tensor."""
  st = hf_sharded.SafetensorsFolder(cfg.hf_path)
  mcfg = ModelConfig.from_config(cfg)
  fm = hf_sharded.folder_map(get_hf_map(cfg.hf_model_type), st.tensors, mcfg)
  hf_sharded.check_folder(st, fm, mcfg, hf_sharded.flatten(make_model_def(mcfg).abstract_params))
  return st
