"""`train.py --help` / `-h`: how to call it, examples, and every config key train.py reads with its
one-line description (the schema, MaxText/config/schema.py; `config/cli.py: key_lines`) and its
default in the CONFIG.yml given (configs/base.yml when none). Imports nothing heavy (no jax), so
help comes back at once."""
from __future__ import annotations

import os
from typing import Any

import yaml

from MaxText.config import yaml_io
from MaxText.config.cli import key_lines, wants_help
from MaxText.config.load import BASE_YML
from MaxText.config.tools import exit_status_line, usage_head

HEAD = usage_head("train") + """\
Trains the model CONFIG.yml (normally configs/base.yml) describes; each key=value overrides one
key below (model_name=X overlays configs/models/X.yml first). Rerunning the same command resumes
from the run's latest checkpoint; a second run with the same run_name while one is running is
refused. Keys are checked before anything compiles (a bad one exits 2 naming it).

examples:
  train.py configs/base.yml    # the default model on the embedded text (CPU is fine)
  train.py configs/base.yml model_name=qwen3-tiny steps=100 run_name=q3
  train.py configs/base.yml dataset_type=file dataset_path='data/*.jsonl' tokenizer_path=TOKENIZER_DIR
  # fine-tune a converted checkpoint (its architecture and tokenizer come with it):
  train.py configs/base.yml load_parameters_path=CKPT run_name=ft
  # 8 fake CPU devices, parameters sharded 8 ways:
  XLA_FLAGS=--xla_force_host_platform_device_count=8 train.py configs/base.yml ici_fsdp_parallelism=8

Output: <base_output_directory>/<run_name>/ (config.yml, metrics.jsonl, tensorboard/,
checkpoints/). More: README.md.

""" + exit_status_line("train") + "\n"

def _defaults(config_yml: str) -> dict[str, Any]:
  """The keys CONFIG.yml sets (nothing when it cannot be read: help still prints)."""
  try:
    with open(config_yml, encoding="utf-8") as f:
      values = yaml_io.safe_load(f)
  except (OSError, yaml.YAMLError):
    return {}
  return values if isinstance(values, dict) else {}


def usage(config_yml: str = BASE_YML) -> str:
  return HEAD + f"\nkeys and defaults ({os.path.relpath(config_yml)}; any other key is refused):" + \
      "\n".join(key_lines("train", _defaults(config_yml))) + "\n"


__all__ = ["usage", "wants_help"]
