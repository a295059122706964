"""Hugging Face folder → our checkpoint (parameters + the model config).

  python -m MaxText.checkpoint_conversion.to_maxtext hf_path=HF_DIR output_path=CKPT [key=value ...]

Reads `HF_DIR/config.json` (model_type picks the family's name map) and the safetensors shard(s)
one tensor at a time, and writes `CKPT/0/{params,meta,tokenizer}` — which `train.py
load_parameters_path=CKPT` fine-tunes from, with the folder's tokenizer files (tokenizer.json,
tokenizer_config.json, chat template, special tokens, *.model; `checkpoint/tokenizer_files.py`).
Extra key=value pairs are config overrides that do not change the architecture (e.g.
`scan_layers=false`, `weight_dtype=bfloat16`). With `adapter_path=PEFT_DIR` a PEFT LoRA adapter
folder of that model is imported too: the checkpoint then holds the base and our adapters
(lora_rank / lora_alpha from its adapter_config.json). The checkpoint's `meta` item records the
folder it came from (`hf_source`, its absolute path): a PEFT export of adapters trained on this
checkpoint names it as their base (`base_model_name_or_path`), and tools that compare a
checkpoint's data keys with their own know a conversion's say nothing about its training.

Examples:
  python -m MaxText.checkpoint_conversion.to_maxtext hf_path=~/Qwen3-0.6B output_path=ckpt/qwen3
  python -m MaxText.checkpoint_conversion.to_maxtext hf_path=hf_llama output_path=ckpt/llama \\
      weight_dtype=bfloat16 scan_layers=false
"""
from __future__ import annotations

import sys

from MaxText.config import cli
from MaxText.config.load import ConfigError

ARGS = {"output_path": cli.Arg(help="where our checkpoint is written (must not exist or be empty)"),
        "adapter_path": cli.Arg(str, "", "a PEFT LoRA adapter folder for the model of hf_path: "
                                "written as our adapters (lora_rank, lora_alpha, lora_targets "
                                "from its adapter_config.json)")}

if __name__ == "__main__":   # --help and a bad argument: answered before jax is imported
  cli.answer_early(sys.argv[1:], ARGS, __doc__, tool="to_maxtext",
                   bad_input=(ConfigError, ValueError, KeyError, FileNotFoundError))

import os
import re
from typing import Iterable

import jax
import numpy as np
from flax.traverse_util import flatten_dict

from MaxText.checkpoint import tokenizer_files
from MaxText.checkpoint.manager import HF_SOURCE, save_params_only
from MaxText.checkpoint_conversion import peft_adapters
from MaxText.checkpoint_conversion.hf_io import HFFolderError, HFTensors, read_config
from MaxText.config.load import BASE_YML, coerce, load_config, parse_overrides, replace
from MaxText.config.schema import ARCHITECTURE_KEYS, Config
from MaxText.layers import lora
from MaxText.models.model_config import ModelConfig
from MaxText.models.registry import check_model, get_hf_map, make_model_def
from MaxText.runtime.exit_codes import reported


def config_for_hf(hf_config: dict, overrides: list[str],
                  tensor_names: Iterable[str] | None = None) -> Config:
  """Our config of an HF checkpoint: its config.json, plus what a name map reads from the names of
  its tensors where config.json is silent (`config_from_tensor_names`, when the map has one)."""
  family = get_hf_map(hf_config["model_type"])
  # a family may name the exported type itself (a multimodal checkpoint exports its text model)
  values = {"hf_model_type": hf_config["model_type"], **family.config_from_hf(hf_config)}
  if tensor_names is not None and hasattr(family, "config_from_tensor_names"):
    values.update(family.config_from_tensor_names(tensor_names))
  cfg = replace(load_config([BASE_YML]), **values)
  changed = parse_overrides(overrides)
  arch = ARCHITECTURE_KEYS - {"scan_layers"}   # the parameters' layout, not the model, may be chosen
  for key in changed:
    if key in arch:
      raise ConfigError(f"{key}: the architecture comes from config.json; it cannot be overridden")
  cfg = replace(cfg, **{k: coerce(k, v, from_text=True) for k, v in changed.items()})
  for key, problem in check_model(ModelConfig.from_config(cfg), cfg.hf_model_type):
    raise ConfigError(f"{key}: {problem}")
  return cfg


def _as_jax_array(a: np.ndarray) -> jax.Array:
  try:
    return jax.device_put(a, may_alias=True)
  except TypeError:  # a JAX without `may_alias`: a copy, one leaf at a time
    return jax.device_put(a)


def convert(hf_path: str, output_path: str, overrides: list[str], adapter_path: str = ""
            ) -> Config:
  if os.path.exists(output_path) and os.listdir(output_path):
    raise ConfigError(f"output_path '{output_path}' exists and is not empty")
  cfg, params = load_hf(hf_path, overrides)
  if adapter_path:
    cfg, params = with_peft_adapters(cfg, params, adapter_path)
  # wrap each (64-byte aligned) NumPy leaf in a JAX array without a copy, so the checkpoint is
  # written from the one copy of the weights (Orbax takes jax.Arrays without staging copies)
  params = jax.tree.map(_as_jax_array, params)
  save_params_only(output_path, params, cfg.as_dict(),
                   tokenizer=tokenizer_files.files_of(hf_path),
                   meta={HF_SOURCE: os.path.abspath(os.path.expanduser(hf_path))})
  return cfg


def load_hf(hf_path: str, overrides: list[str]) -> tuple[Config, dict]:
  """(our config, our parameters as host NumPy arrays) of a Hugging Face folder, in memory."""
  hf_config = read_config(hf_path)
  tensors = HFTensors(hf_path)
  tokenizer = tokenizer_files.files_of(hf_path)
  # the vocabulary is a real tokenizer's: a run from this checkpoint never falls back to bytes
  cfg = replace(config_for_hf(hf_config, overrides, tensors), tokenizer_type="huggingface" if
                "tokenizer.json" in tokenizer or not tokenizer else "sentencepiece")
  return cfg, hf_params(hf_path, cfg, tensors)


def hf_params(hf_path: str, cfg: Config, tensors: HFTensors | None = None) -> dict:
  """The parameters of the Hugging Face folder `hf_path` as host NumPy arrays, for the model of
  `cfg` (its architecture already the folder's: `load_hf`, or the tools' resolver,
  MaxText/resolve/architecture.py). HFFolderError (exit 4) naming a parameter that does not fit."""
  tensors = HFTensors(hf_path) if tensors is None else tensors
  mcfg = ModelConfig.from_config(cfg)
  family = get_hf_map(cfg.hf_model_type)
  params = family.hf_to_params(tensors, mcfg)
  want = make_model_def(mcfg).abstract_params
  flat_want = {jax.tree_util.keystr(p): s for p, s in jax.tree_util.tree_leaves_with_path(want)}
  flat_got = {jax.tree_util.keystr(p): a for p, a in jax.tree_util.tree_leaves_with_path(params)}
  if set(flat_want) != set(flat_got):
    raise HFFolderError(f"{hf_path}: converted parameters {sorted(set(flat_got) ^ set(flat_want))} "
                        f"do not match the model")
  for name, s in flat_want.items():
    if tuple(flat_got[name].shape) != tuple(s.shape):
      raise HFFolderError(f"{hf_path}: parameter {name} has shape {tuple(flat_got[name].shape)}, "
                          f"config.json implies {tuple(s.shape)}")
  return params


def with_peft_adapters(cfg: Config, params: dict, adapter_path: str) -> tuple[Config, dict]:
  """(the config with lora_* keys, the parameters with adapters) of a PEFT folder's adapters
  (checkpoint_conversion/peft_adapters.py) on the base `params`; lora_targets names exactly the
  projections the folder adapts."""
  peft_config = peft_adapters.read_peft_config(adapter_path)
  rank, alpha = peft_config["r"], float(peft_config.get("lora_alpha") or peft_config["r"])
  family = get_hf_map(cfg.hf_model_type)
  base_mcfg = ModelConfig.from_config(cfg)
  every = replace(cfg, lora_rank=rank, lora_alpha=alpha, lora_targets=".")   # each projection
  shapes = flatten_dict(make_model_def(ModelConfig.from_config(every)).abstract_params)
  places = peft_adapters.places(family, base_mcfg, shapes)
  wanted = set(peft_adapters.adapted_modules(adapter_path))
  unknown = sorted(wanted - {n[:-len(".weight")] for n in places})
  if unknown:
    raise HFFolderError(f"{adapter_path}: {unknown[:4]} are not projections our adapters cover")
  paths = sorted({"/".join(map(str, p.kernel)) for n, p in places.items()
                  if n[:-len(".weight")] in wanted})
  cfg = replace(cfg, lora_rank=rank, lora_alpha=alpha,
                lora_targets="^(" + "|".join(re.escape(p) for p in paths) + ")$")
  abstract = make_model_def(ModelConfig.from_config(cfg)).abstract_params
  adapters = lora.split(jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), abstract))[0]
  params = peft_adapters.import_peft(adapter_path, lora.join(adapters, params), family,
                                     base_mcfg, rank=rank)
  return cfg, params


def main(argv: list[str]) -> int:
  def run() -> int:
    parsed = cli.parse(argv, ARGS, __doc__, tool="to_maxtext")
    if parsed is None:
      return 0
    args, given, config_argv = parsed
    hf_path = os.path.expanduser(cli.require(given, "hf_path", "a Hugging Face model folder "
                                             "(config.json + safetensors)"))
    overrides = [a for a in config_argv[1:] if not a.startswith("hf_path=")]
    cfg = convert(hf_path, args["output_path"], overrides,
                  os.path.expanduser(args["adapter_path"]))
    tokenizer = sorted(tokenizer_files.files_of(hf_path))
    print(f"wrote {args['output_path']} ({cfg.hf_model_type}: {cfg.num_decoder_layers} layers, "
          f"d={cfg.emb_dim}, vocab {cfg.vocab_size}); tokenizer files: "
          + (", ".join(tokenizer) if tokenizer else "none in hf_path (fine-tuning will need "
                                                    "tokenizer_path=...)"))
    return 0
  return reported(run, (ConfigError, HFFolderError, ValueError, KeyError, FileNotFoundError))

if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
