"""The one way a run or a tool gets its model's architecture: the user's config file, then the
Hugging Face folder's (`hf_path`, from_hf.py) or the checkpoint's (`load_parameters_path`,
from_checkpoint.py) architecture, then the command line.

`load_config(argv)` reads the config file and applies the command line; `adopt_architecture`
then replaces the architecture keys with the folder's or the checkpoint's: a config file's value
gives way, a command-line (or `model_name` file) value that disagrees is refused naming both
(exit 2). Every other key of the config file stands (a decode's `decode_batch_size`, a server's
`max_cache_length`, an evaluation's batch). train.py (`train/loop.py: build`) and the tools
(`MaxText/inference.py: resolve_config`: decode, serve, lm-eval, inspect, evaluate, the Python
API) call it; a training run adds its own refusals and takes the folder's tokenizer
(`adopt_hf_architecture`).
"""
from __future__ import annotations

from typing import Sequence

from MaxText.config.schema import Config
from MaxText.resolve.from_checkpoint import adopt_checkpoint_architecture
from MaxText.resolve.from_hf import adopt_hf_architecture, hf_architecture


def adopt_architecture(cfg: Config, argv: Sequence[str], *, training: bool) -> Config:
  """`cfg` = `load_config(argv)` with the architecture of `hf_path` or `load_parameters_path`
  (module docstring); as it is when neither is set. `training`: train.py's refusals and
  tokenizer (`adopt_hf_architecture`). ConfigError (exit 2), CheckpointError (exit 4)."""
  if cfg.hf_path:
    return adopt_hf_architecture(cfg, argv) if training else hf_architecture(cfg, argv)
  if cfg.load_parameters_path:
    return adopt_checkpoint_architecture(cfg, argv)
  return cfg
