"""Our checkpoint → a Hugging Face folder that `transformers.AutoModelForCausalLM.from_pretrained`
loads unchanged.

  python -m MaxText.checkpoint_conversion.to_huggingface load_parameters_path=CKPT output_path=OUT \\
      [max_shard_gb=5] [hf_model_type=TYPE]

CKPT is a run's `checkpoints/` directory (its latest step), one step directory, or a converter's
output. The model config travels in the checkpoint; its `hf_model_type` picks the name map — when
it is "" (a model trained from configs/base.yml), the first of its family's Hugging Face types that
can hold the model (the default model: `llama`), or the `hf_model_type` argument. Tensors are
written in the checkpoint's weight dtype as `config.json` + `model.safetensors`, or numbered
shards + index above `max_shard_gb`; the checkpoint's tokenizer files are written next to them
(`checkpoint/tokenizer_files.py`; a byte-level model's byte tokenizer as a tokenizer.json,
`byte_tokenizer.py`), so `AutoTokenizer` loads the folder too. The tokenizer's special
tokens (bos, eos and a pad it names; the byte tokenizer's own ids for a byte-level model) go into
`config.json` as `bos_token_id` / `eos_token_id` / `pad_token_id` and into a
`generation_config.json`, so transformers' `generate` on the export stops at the eos (e.g.
`<|im_end|>` of a chat tokenizer). A LoRA checkpoint
(lora_rank > 0) is written merged (each adapted kernel W + alpha/r A B: a plain model), or with
adapter_format=peft as a PEFT adapter folder for `peft.PeftModel.from_pretrained(base, OUT)`; its
`base_model_name_or_path` is the Hugging Face folder the adapters' base checkpoint was converted
from (to_maxtext records it), so `peft.AutoPeftModelForCausalLM.from_pretrained(OUT)` finds the
base; a base that is no conversion (a run's own checkpoint) is named by its path, and the export
says to export that base with this tool to load the adapter onto it.

Examples:
  python -m MaxText.checkpoint_conversion.to_huggingface \\
      load_parameters_path=runs/default/checkpoints output_path=hf_out
  python -m MaxText.checkpoint_conversion.to_huggingface load_parameters_path=runs/ft/checkpoints/200 \\
      output_path=hf_out max_shard_gb=2
  python -m MaxText.checkpoint_conversion.to_huggingface load_parameters_path=runs/lora/checkpoints \\
      output_path=adapter_out adapter_format=peft
"""
from __future__ import annotations

import sys

from MaxText.config import cli
from MaxText.config.load import ConfigError

ARGS = {
    "output_path": cli.Arg(help="the Hugging Face folder to write (must not exist or be empty)"),
    "max_shard_gb": cli.Arg(float, 5.0, "largest safetensors shard"),
    "adapter_format": cli.Arg(str, "merged", "a LoRA checkpoint: merged (the base with W + "
                              "alpha/r A B) | peft (adapter_config.json + "
                              "adapter_model.safetensors for peft.PeftModel.from_pretrained)"),
}

if __name__ == "__main__":   # --help and a bad argument: answered before jax is imported
  cli.answer_early(sys.argv[1:], ARGS, __doc__, tool="to_huggingface",
                   bad_input=(ConfigError, ValueError, KeyError, FileNotFoundError))

import dataclasses
import os
from typing import Any

from MaxText.checkpoint import tokenizer_files
from MaxText.checkpoint.manager import hf_source, read_meta, resolve_step_dir
from MaxText.checkpoint_conversion import byte_tokenizer, peft_adapters
from MaxText.checkpoint_conversion.hf_io import write_hf_folder, write_json
from MaxText.config.load import BASE_YML, load_config, replace
from MaxText.config.schema import AUTO_TOOL_DTYPE, KEYS, Config
from MaxText.data import tokenizers
from MaxText.layers import lora
from MaxText.models.model_config import ModelConfig
from MaxText.models.registry import check_model, get_hf_map, hf_model_type_for, make_model_def
from MaxText.quantization import convert
from MaxText.resolve import lora_base
from MaxText.resolve.from_checkpoint import check_quantized_layout
from MaxText.runtime.exit_codes import reported
from MaxText.storage import paths


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
  return replace(cfg, weight_bits=0, weight_group_size=0, weight_quant_exclude="",
                 weight_quant_vocab=False)


def host_params(ckpt: str, cfg: Config) -> Any:
  """The parameters of checkpoint `ckpt` (its config `cfg`) as host floats: a LoRA checkpoint's
  adapters joined with its referenced base, a quantized checkpoint's integer weights dequantized
  (what the quantized model computes), in the structure of `float_config(cfg)`'s model."""
  stored = ModelConfig.from_config(cfg)
  params = lora_base.load_host(ckpt, stored, make_model_def(stored).abstract_params)
  if stored.weight_bits:
    mcfg = ModelConfig.from_config(float_config(cfg))
    params = convert.dequantized(params, convert.targets(mcfg, stored.weight_quant_exclude,
                                                         stored.weight_quant_vocab),
                                 stored.weight_bits, mcfg.param_dtype)
  return params


def export(ckpt: str, output_path: str, max_shard_bytes: int, hf_model_type: str = "",
           adapter_format: str = "merged") -> str:
  """Writes the Hugging Face folder (a LoRA checkpoint: merged, or its PEFT adapter folder);
  returns the model_type written."""
  if adapter_format not in ("merged", "peft"):
    raise ConfigError(f"adapter_format={adapter_format!r}: merged or peft")
  if paths.listdir(output_path):
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
      if paths.is_url(output_path):
        raise ConfigError(f"output_path '{output_path}': adapter_format=peft writes a local "
                          "folder (copy it to the object store afterwards)")
      peft_adapters.export_peft(output_path, params, family, base, rank=cfg.lora_rank,
                                alpha=cfg.lora_alpha, base_model=peft_base(ckpt, cfg))
      return model_type
    params, mcfg = lora.merged(params, cfg.lora_alpha / cfg.lora_rank), base
  elif adapter_format == "peft":
    raise ConfigError(f"adapter_format=peft: checkpoint '{ckpt}' has no LoRA adapters "
                      "(lora_rank=0)")
  tensors = family.params_to_hf(params, mcfg)
  ids = special_token_ids(resolve_step_dir(ckpt), cfg)
  write_hf_folder(output_path, tensors, {**family.config_to_hf(cfg), **ids},
                  max_shard_bytes=max_shard_bytes)
  if ids:
    write_json(paths.join(output_path, "generation_config.json"),
               {**ids, "_from_model_config": True})
  step_dir = resolve_step_dir(ckpt)
  tokenizer_files.export(step_dir, output_path)
  if tokenizer_files.in_checkpoint(step_dir) is None and cfg.tokenizer_type in ("byte", "auto"):
    byte_tokenizer.write(output_path)   # a byte-level model: its tokenizer as transformers reads it
  return model_type


def special_token_ids(step_dir: str, cfg: Config) -> dict[str, int]:
  """{"bos_token_id", "eos_token_id", "pad_token_id"} of the checkpoint's tokenizer (its files in
  the checkpoint; the byte tokenizer of a byte-level model), each only where the tokenizer has
  that token; {} when the checkpoint carries no tokenizer files of its real tokenizer."""
  folder = tokenizer_files.in_checkpoint(step_dir)
  if folder is not None:
    tok = tokenizers.make_tokenizer("auto", folder)
  elif cfg.tokenizer_type in ("byte", "auto"):
    tok = tokenizers.ByteTokenizer()
  else:
    print(f"note: checkpoint '{step_dir}' carries no tokenizer files: config.json gets no "
          "bos/eos/pad token ids and no generation_config.json is written", file=sys.stderr)
    return {}
  ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.named_pad_id}
  return {k: int(v) for k, v in ids.items() if v is not None}


def peft_base(ckpt: str, cfg: Config) -> str:
  """What a PEFT export names as its base: the Hugging Face folder the adapters' base checkpoint
  was converted from, else that checkpoint's path (with a note)."""
  ref = lora_base.checkpoint_reference(ckpt)
  base = (ref or {}).get("path") or cfg.load_parameters_path
  source = hf_source(base) if base and os.path.isdir(base) else None
  if source:
    return source
  print(f"note: the adapters' base {base or '(the random init)'} is no conversion of a Hugging "
        "Face folder; adapter_config.json names it as base_model_name_or_path: export that base "
        "with to_huggingface and give its folder to peft", file=sys.stderr)
  return base


def main(argv: list[str]) -> int:
  def run() -> int:
    parsed = cli.parse(argv, ARGS, __doc__, tool="to_huggingface")
    if parsed is None:
      return 0
    args, given, _ = parsed
    ckpt = cli.require(given, "load_parameters_path", "the checkpoint (a run's checkpoints/, a "
                       "step, a to_maxtext output)")
    model_type = export(ckpt, args["output_path"], int(args["max_shard_gb"] * 2**30),
                        given.hf_model_type, args["adapter_format"])
    print(f"wrote {args['output_path']} ({model_type})")
    return 0
  return reported(run, (ConfigError, ValueError, KeyError, FileNotFoundError))

if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
