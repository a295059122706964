"""Cross-key checks that need the devices or the model family (its refusals of keys it does not
implement, its own checks, its Hugging Face model types), and `check_config`: everything a run or
a tool checks before anything compiles. Every failure is a `ConfigError` naming the key(s) and the
numbers (a `DataError` for the data config)."""
from __future__ import annotations

import math
import os
from typing import Sequence


from MaxText.config.load import ConfigError
from MaxText.config.schema import KEYS, MESH_AXES, Config
from MaxText.data.tokenizers import Tokenizer
from MaxText.layers import pipeline, quant
from MaxText.layers.attention_ops import attention_problems
from MaxText.models.model_config import ModelConfig
from MaxText.models.registry import check_model, get_family
from MaxText.resolve.auto_settings import has_logits_head
from MaxText.runtime.run_dir import check_writable
from MaxText.sharding.mesh import mesh_shape
from MaxText.sharding.rules import parse_rules
from MaxText.backend.device_type import Device

BATCH_AXES_LOGICAL = "activation_batch"


def validate(cfg: Config, devices: Sequence[Device]) -> None:
  for axis in cfg.mesh_axes:
    if axis not in MESH_AXES:
      raise ConfigError(f"mesh_axes: unknown axis '{axis}' (known: {', '.join(MESH_AXES)})")
  if sorted(cfg.mesh_axes) != sorted(MESH_AXES):
    raise ConfigError(f"mesh_axes={cfg.mesh_axes} must list each of {list(MESH_AXES)} once")
  rules = parse_rules(cfg.logical_axis_rules, cfg.mesh_axes)
  ici, dcn = mesh_shape(cfg, devices)
  sizes = {a: i * d for a, i, d in zip(cfg.mesh_axes, ici, dcn)}

  mcfg = ModelConfig.from_config(cfg)
  for key, problem in check_model(mcfg, cfg.hf_model_type) + quant.problems(mcfg):
    raise ConfigError(f"{key}: {problem}")
  batch_axes = next((axes for name, axes in rules if name == BATCH_AXES_LOGICAL), ())
  length_axes = next((axes for name, axes in rules if name == "activation_length"), ())
  family = get_family(cfg.decoder_block)
  sequence_sharded = math.prod(sizes[a] for a in length_axes if a not in batch_axes) > 1
  if sequence_sharded and not family.context_parallel:
    raise ConfigError(f"ici_context_parallelism / dcn_context_parallelism: decoder_block="
                      f"{family.name} has layers that run a whole sequence per shard (a "
                      f"recurrence over the sequence), so the sequence cannot be sharded over "
                      f"the context axis (context parallelism is not supported); set both to 1 "
                      f"and shard the batch (data / fsdp) instead")
  for key, problem in attention_problems(
      cfg.attention, mcfg.attention, device=devices[0], dtype=cfg.dtype,
      head_dims=list(family.attention_head_dims(mcfg)), sequence_sharded=sequence_sharded):
    raise ConfigError(f"{key}: {problem}")

  # a chunk the user set (> 0; -1 = auto resolves to the whole sequence for such a family)
  if cfg.loss_chunk_length > 0 and not has_logits_head(cfg.decoder_block):
    raise ConfigError(f"loss_chunk_length={cfg.loss_chunk_length}: decoder_block="
                      f"{cfg.decoder_block} has no separate LM head (`logits`) to apply chunk by "
                      f"chunk; use loss_chunk_length=0 (or -1, auto)")

  ep = sizes["expert"]
  if cfg.num_experts and ep > 1:
    where = (f" (taken from the checkpoint at load_parameters_path={cfg.load_parameters_path})"
             if cfg.load_parameters_path else "")
    if cfg.num_experts % ep:
      raise ConfigError(f"ici_expert_parallelism={cfg.ici_expert_parallelism} x "
                        f"dcn_expert_parallelism={cfg.dcn_expert_parallelism}: {ep} expert shards "
                        f"do not divide num_experts={cfg.num_experts}{where}")
    if cfg.capacity_factor > 0:
      raise ConfigError(f"capacity_factor={cfg.capacity_factor:g} is a single-shard comparison "
                        f"mode; it cannot run with {ep}-way expert parallelism")

  if cfg.max_target_length > cfg.max_position_embeddings:
    raise ConfigError(f"max_target_length={cfg.max_target_length} exceeds the model's position "
                      f"limit max_position_embeddings={cfg.max_position_embeddings}")

  n = len(devices)
  micro = cfg.per_device_batch_size * n
  if abs(micro - round(micro)) > 1e-9 or round(micro) < 1:
    raise ConfigError(f"per_device_batch_size={cfg.per_device_batch_size} x {n} devices = {micro:g} "
                      f"is not a whole number of sequences")
  dp = math.prod(sizes[a] for a in batch_axes)
  if round(micro) % dp:
    raise ConfigError(
        f"per_device_batch_size: the micro-batch of {round(micro)} sequences "
        f"(per_device_batch_size={cfg.per_device_batch_size} x {n} devices) does not divide over "
        f"the {dp}-way data-parallel mesh axes {list(batch_axes)}")
  schedule = pipeline.schedule_of(cfg, sizes)
  if schedule is not None:
    for keys, problem in pipeline.problems(
        num_layers=cfg.num_decoder_layers, stages=schedule.stages,
        microbatches=schedule.microbatches, repeats=schedule.repeats, batch=round(micro)):
      raise ConfigError(f"{keys}: {problem} (ici_pipeline_parallelism="
                        f"{cfg.ici_pipeline_parallelism} x dcn_pipeline_parallelism="
                        f"{cfg.dcn_pipeline_parallelism} = {schedule.stages} stages)")
  if cfg.max_target_length % sizes["context"]:
    raise ConfigError(f"max_target_length={cfg.max_target_length} does not divide over "
                      f"ici/dcn_context_parallelism={sizes['context']}")
  if sequence_sharded and mcfg.attention == "flash" and cfg.max_target_length % (2 * sizes["context"]):
    raise ConfigError(f"max_target_length={cfg.max_target_length}: attention=flash over "
                      f"ici/dcn_context_parallelism={sizes['context']} holds two chunks per shard "
                      f"(the load-balanced order), so the length must be a multiple of "
                      f"{2 * sizes['context']}")
  if not cfg.profiler:
    for key in ("skip_first_n_steps_for_profiler", "profiler_steps"):
      if getattr(cfg, key) != KEYS[key].default:
        raise ConfigError(f"{key}={getattr(cfg, key)}: applies only with profiler=xplane "
                          f"(profiler is off); set profiler=xplane or leave {key} at its "
                          f"default ({KEYS[key].default})")
  elif cfg.skip_first_n_steps_for_profiler >= cfg.steps:
    raise ConfigError(f"skip_first_n_steps_for_profiler={cfg.skip_first_n_steps_for_profiler}: "
                      f"the run has steps={cfg.steps}, so profiler=xplane would trace nothing")
  global_batch = cfg.global_batch_size(n)
  if cfg.data_shards and global_batch % cfg.data_shards:
    raise ConfigError(f"data_shards={cfg.data_shards} does not divide the global batch of "
                      f"{global_batch} sequences (per_device_batch_size={cfg.per_device_batch_size}"
                      f" x {n} devices x gradient_accumulation_steps="
                      f"{cfg.gradient_accumulation_steps})")


def check_config(cfg: Config, devices: Sequence[Device]) -> Tokenizer | None:
  """Everything that can be checked before any compile (raises ConfigError / DataError): the run
  directory, the cross-key checks (`validate`), evaluation's data when `eval_period` > 0, the data
  config; returns the run's tokenizer (loaded once, to check it against the config; None for
  synthetic data of a model whose tokenizer files are not at hand)."""
  # the data modules (grain underneath) only here: a decode or a server that calls `validate`
  # alone starts without them
  from MaxText.data.config import DataConfig  # pylint: disable=import-outside-toplevel
  from MaxText.data.eval_data import eval_problems  # pylint: disable=import-outside-toplevel
  from MaxText.data.validation import validate_data_config  # pylint: disable=import-outside-toplevel
  check_writable(cfg)
  validate(cfg, devices)
  if cfg.eval_period:
    for key, problem in eval_problems(DataConfig.from_config(cfg), cfg.eval_dataset_path):
      raise ConfigError(f"{key}: {problem}")
  return validate_data_config(DataConfig.from_config(cfg))


def require_files(cfg: Config, *keys: str) -> None:
  """ConfigError "<key>=<path>: no such file" for the first of `keys` (a data file's path) that is
  set and names no file: a missing input file is a config error (exit 2) in every trainer, as
  train.py's `dataset_path` is (README "Exit status"), refused before the run directory is made."""
  for key in keys:
    path = os.path.expanduser(getattr(cfg, key))
    if path and not os.path.isfile(path):
      raise ConfigError(f"{key}={path}: no such file")


def unpipelined(cfg: Config, method: str) -> list[tuple[str, str]]:
  """(key, why) for each pipeline-stage key > 1 of a method whose step runs no pipeline schedule
  (distillation, DPO, GRPO: only train.py's pre-training/SFT step enters one, train/step.py) —
  refused rather than run un-pipelined (docs/fine-tuning.md, "Methods and features")."""
  return [(key, f"{key}={getattr(cfg, key)}: {method} runs without a pipeline schedule (only "
           f"train.py's pre-training/SFT step pipelines); set {key}=1")
          for key in ("ici_pipeline_parallelism", "dcn_pipeline_parallelism")
          if getattr(cfg, key) > 1]
