"""Our checkpoint → a Hugging Face folder that `transformers.AutoModelForCausalLM.from_pretrained`
loads unchanged.

  python -m MaxText.checkpoint_conversion.to_huggingface load_parameters_path=CKPT output_path=OUT \
      [max_shard_gb=5]

CKPT is a run's `checkpoints/` directory (its latest step), one step directory, or a converter's
output. The model config travels in the checkpoint; its `hf_model_type` picks the name map.
Tensors are written in the checkpoint's weight dtype as `config.json` + `model.safetensors`, or
numbered shards + index above `max_shard_gb`; the checkpoint's tokenizer files are written next to
them (`checkpoint/tokenizer_files.py`), so `AutoTokenizer` loads the folder too.
"""
from __future__ import annotations

import os
import sys


from MaxText.checkpoint import tokenizer_files
from MaxText.checkpoint.manager import load_params_host, read_meta, resolve_step_dir
from MaxText.checkpoint_conversion.hf_io import write_hf_folder
from MaxText.checkpoint_conversion.to_maxtext import BASE_YML, split_args
from MaxText.config.load import ConfigError, load_config, replace
from MaxText.config.schema import FIELDS, Config
from MaxText.models.model_config import ModelConfig
from MaxText.models.registry import get_hf_map
from MaxText.train.state import make_model_def


def checkpoint_config(path: str) -> Config:
  """The config stored in a checkpoint (keys unknown to this version are an error)."""
  saved = read_meta(path)["config"]
  unknown = sorted(set(saved) - set(FIELDS))
  if unknown:
    raise ConfigError(f"checkpoint '{path}' config has keys this version does not know: {unknown}")
  return replace(load_config([BASE_YML]), **saved)


def export(ckpt: str, output_path: str, max_shard_bytes: int) -> Config:
  if os.path.exists(output_path) and os.listdir(output_path):
    raise ConfigError(f"output_path '{output_path}' exists and is not empty")
  cfg = checkpoint_config(ckpt)
  if not cfg.hf_model_type:
    raise ConfigError(f"checkpoint '{ckpt}' has hf_model_type='' (not a Hugging Face "
                      f"architecture); set it when converting or training")
  family = get_hf_map(cfg.hf_model_type)
  mcfg = ModelConfig.from_config(cfg)
  params = load_params_host(ckpt, make_model_def(mcfg).abstract_params)
  tensors = family.params_to_hf(params, mcfg)
  write_hf_folder(output_path, tensors, family.config_to_hf(cfg), max_shard_bytes=max_shard_bytes)
  tokenizer_files.export(resolve_step_dir(ckpt), output_path)
  return cfg


def main(argv: list[str]) -> int:
  try:
    args, rest = split_args(argv, ("load_parameters_path", "output_path"))
    extra = dict(a.split("=", 1) for a in rest)
    shard_gb = float(extra.pop("max_shard_gb", 5))
    if extra:
      raise ConfigError(f"unknown argument(s): {', '.join(extra)} (known: load_parameters_path, "
                        f"output_path, max_shard_gb)")
    cfg = export(args["load_parameters_path"], args["output_path"], int(shard_gb * 2**30))
  except (ConfigError, ValueError, KeyError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"wrote {args['output_path']} ({cfg.hf_model_type})")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
