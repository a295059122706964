"""Our checkpoint → a Hugging Face folder that `transformers.AutoModelForCausalLM.from_pretrained`
loads unchanged.

  python -m MaxText.checkpoint_conversion.to_huggingface load_parameters_path=CKPT output_path=OUT \
      [max_shard_gb=5] [hf_model_type=TYPE]

CKPT is a run's `checkpoints/` directory (its latest step), one step directory, or a converter's
output. The model config travels in the checkpoint; its `hf_model_type` picks the name map — when
it is "" (a model trained from configs/base.yml), the first of its family's Hugging Face types that
can hold the model (the default model: `llama`), or the `hf_model_type` argument. Tensors are
written in the checkpoint's weight dtype as `config.json` + `model.safetensors`, or numbered
shards + index above `max_shard_gb`; the checkpoint's tokenizer files are written next to them
(`checkpoint/tokenizer_files.py`), so `AutoTokenizer` loads the folder too. A LoRA checkpoint
(lora_rank > 0) is written merged (each adapted kernel W + alpha/r A B: a plain model), or with
adapter_format=peft as a PEFT adapter folder for `peft.PeftModel.from_pretrained(base, OUT)` (the
base: the Hugging Face model the run started from).

Examples:
  python -m MaxText.checkpoint_conversion.to_huggingface \
      load_parameters_path=runs/default/checkpoints output_path=hf_out
  python -m MaxText.checkpoint_conversion.to_huggingface load_parameters_path=runs/ft/checkpoints/200 \
      output_path=hf_out max_shard_gb=2
  python -m MaxText.checkpoint_conversion.to_huggingface load_parameters_path=runs/lora/checkpoints \
      output_path=adapter_out adapter_format=peft
"""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

from MaxText.checkpoint import tokenizer_files
from MaxText.checkpoint.manager import read_meta, resolve_step_dir
from MaxText.checkpoint_conversion import peft_adapters
from MaxText.checkpoint_conversion.hf_io import write_hf_folder
from MaxText.config import cli
from MaxText.config.load import BASE_YML, ConfigError, load_config, replace
from MaxText.config.schema import AUTO_TOOL_DTYPE, KEYS, Config
from MaxText.layers import lora
from MaxText.models.model_config import ModelConfig
from MaxText.models.registry import check_model, get_hf_map, hf_model_type_for, make_model_def
from MaxText.quantization import convert
from MaxText.resolve import lora_base
from MaxText.resolve.from_checkpoint import check_quantized_layout
from MaxText.runtime.exit_codes import reported

ARGS = {
    "load_parameters_path": cli.Arg(help="a run's checkpoints/ directory, a step, or a "
                                    "to_maxtext output"),
    "output_path": cli.Arg(help="the Hugging Face folder to write (must not exist or be empty)"),
    "max_shard_gb": cli.Arg(float, 5.0, "largest safetensors shard"),
    "hf_model_type": cli.Arg(str, "", "the architecture to write when the checkpoint has none"),
    "adapter_format": cli.Arg(str, "merged", "a LoRA checkpoint: merged (the base with W + "
                              "alpha/r A B) | peft (adapter_config.json + "
                              "adapter_model.safetensors for peft.PeftModel.from_pretrained)"),
}


def checkpoint_config(path: str) -> Config:
  """The config stored in a checkpoint, as a tool computes with it (keys unknown to this version
  are an error). The compute dtype the training run used (bfloat16 by default, `dtype=auto`) is
  not kept: a tool computes in the tools' dtype (float32, where the Hugging Face parity is exact)
  unless its caller sets another."""
  saved = read_meta(path)["config"]
  unknown = sorted(set(saved) - set(KEYS))
  if unknown:
    raise ConfigError(f"checkpoint '{path}' config has keys this version does not know: {unknown}")
  cfg = replace(load_config([BASE_YML]), **{**saved, "dtype": AUTO_TOOL_DTYPE})
  check_quantized_layout(cfg, path)
  return cfg


def float_config(cfg: Config) -> Config:
  """The config of the float model a (possibly quantized) checkpoint's config describes."""
  if not cfg.weight_bits:
    return cfg
  return replace(cfg, weight_bits=0, weight_group_size=0, weight_quant_exclude="")


def host_params(ckpt: str, cfg: Config) -> Any:
  """The parameters of checkpoint `ckpt` (its config `cfg`) as host floats: a LoRA checkpoint's
  adapters joined with its referenced base, a quantized checkpoint's integer weights dequantized
  (what the quantized model computes), in the structure of `float_config(cfg)`'s model."""
  stored = ModelConfig.from_config(cfg)
  params = lora_base.load_host(ckpt, stored, make_model_def(stored).abstract_params)
  if stored.weight_bits:
    mcfg = ModelConfig.from_config(float_config(cfg))
    params = convert.dequantized(params, convert.targets(mcfg, stored.weight_quant_exclude),
                                 stored.weight_bits, mcfg.param_dtype)
  return params


def export(ckpt: str, output_path: str, max_shard_bytes: int, hf_model_type: str = "",
           adapter_format: str = "merged") -> str:
  """Writes the Hugging Face folder (a LoRA checkpoint: merged, or its PEFT adapter folder);
  returns the model_type written."""
  if adapter_format not in ("merged", "peft"):
    raise ConfigError(f"adapter_format={adapter_format!r}: merged or peft")
  if os.path.exists(output_path) and os.listdir(output_path):
    raise ConfigError(f"output_path '{output_path}' exists and is not empty")
  cfg = checkpoint_config(ckpt)
  if hf_model_type and cfg.hf_model_type and hf_model_type != cfg.hf_model_type:
    raise ConfigError(f"hf_model_type={hf_model_type!r}: the checkpoint is "
                      f"{cfg.hf_model_type!r}")
  saved, cfg = cfg, float_config(cfg)   # a quantized checkpoint is written as its float model
  mcfg = ModelConfig.from_config(cfg)
  model_type = hf_model_type_for(mcfg, cfg.hf_model_type or hf_model_type)
  for key, problem in check_model(mcfg, model_type):
    raise ConfigError(f"{key}: {problem}")
  family = get_hf_map(model_type)
  params = host_params(ckpt, saved)
  if cfg.lora_rank:
    base = dataclasses.replace(mcfg, lora_rank=0)
    if adapter_format == "peft":
      peft_adapters.export_peft(output_path, params, family, base, rank=cfg.lora_rank,
                       alpha=cfg.lora_alpha, base_model=cfg.load_parameters_path)
      return model_type
    params, mcfg = lora.merged(params, cfg.lora_alpha / cfg.lora_rank), base
  elif adapter_format == "peft":
    raise ConfigError(f"adapter_format=peft: checkpoint '{ckpt}' has no LoRA adapters "
                      "(lora_rank=0)")
  tensors = family.params_to_hf(params, mcfg)
  write_hf_folder(output_path, tensors, family.config_to_hf(cfg), max_shard_bytes=max_shard_bytes)
  tokenizer_files.export(resolve_step_dir(ckpt), output_path)
  return model_type


def main(argv: list[str]) -> int:
  def run() -> int:
    parsed = cli.parse(argv, ARGS, __doc__)
    if parsed is None:
      return 0
    args = parsed[0]
    model_type = export(args["load_parameters_path"], args["output_path"],
                        int(args["max_shard_gb"] * 2**30), args["hf_model_type"],
                        args["adapter_format"])
    print(f"wrote {args['output_path']} ({model_type})")
    return 0
  return reported(run, (ConfigError, ValueError, KeyError, FileNotFoundError))

if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
