"""The one typed schema of every config key.

`configs/base.yml` holds each key's default value and a one-line comment; this module holds each
key's type and allowed range. `MaxText.config.load` refuses a base.yml whose keys differ from the
fields here, so the two can never drift apart silently (and `tests/test_config.py` checks it too).

Constraints are written next to the field as `_spec(...)` metadata:
  choices   the allowed values of a str key
  min/max   inclusive numeric bounds
  nonneg    shorthand for min=0
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


def _spec(*, choices: tuple | None = None, min: float | None = None, max: float | None = None,
          gt: float | None = None) -> Any:
  return field(metadata={"choices": choices, "min": min, "max": max, "gt": gt})


MESH_AXES = ("data", "fsdp", "context", "expert", "tensor")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True, kw_only=True)
class Config:
  # ---- run ---------------------------------------------------------------------------------
  run_name: str
  base_output_directory: str
  steps: int = _spec(min=1)
  log_period: int = _spec(min=1)
  seed: int = _spec(min=0)
  jax_cache_dir: str
  # ---- model ---------------------------------------------------------------------------------
  model_name: str
  decoder_block: str
  hf_model_type: str
  vocab_size: int = _spec(min=1)
  emb_dim: int = _spec(min=1)
  num_decoder_layers: int = _spec(min=1)
  num_query_heads: int = _spec(min=1)
  num_kv_heads: int = _spec(min=1)
  head_dim: int = _spec(min=1)
  mlp_dim: int = _spec(min=1)
  mlp_activation: str = _spec(choices=("silu", "gelu_tanh"))
  norm_epsilon: float = _spec(gt=0)
  use_qk_norm: bool
  tie_word_embeddings: bool
  rope_theta: float = _spec(gt=0)
  max_position_embeddings: int = _spec(min=1)
  init_std: float = _spec(gt=0)
  dtype: str = _spec(choices=DTYPES)
  weight_dtype: str = _spec(choices=DTYPES)
  scan_layers: bool
  remat_policy: str = _spec(choices=("none", "full", "save_matmuls"))
  attention: str = _spec(choices=("autoselected", "dot_product", "flash", "cudnn"))
  flash_block_q: int = _spec(min=8)
  flash_block_kv: int = _spec(min=8)
  attention_pattern: str
  sliding_window: int = _spec(min=0)
  attention_scale: float = _spec(min=0)
  global_head_dim: int = _spec(min=0)
  global_num_kv_heads: int = _spec(min=0)
  global_rope_theta: float = _spec(min=0)
  global_rope_fraction: float = _spec(gt=0, max=1)
  attention_k_eq_v: bool
  num_kv_shared_layers: int = _spec(min=0)
  double_wide_mlp_on_shared: bool
  per_layer_input_dim: int = _spec(min=0)
  per_layer_input_vocab_size: int = _spec(min=0)
  final_logit_softcap: float = _spec(min=0)
  num_experts: int = _spec(min=0)
  num_experts_per_tok: int = _spec(min=1)
  moe_mlp_dim: int = _spec(min=0)
  norm_topk_prob: bool
  shared_expert_mlp_dim: int = _spec(min=0)
  capacity_factor: float = _spec(min=0)
  moe_dispatch: str = _spec(choices=("auto", "ragged_all_to_all", "padded_all_to_all"))
  # ---- data ----------------------------------------------------------------------------------
  dataset_type: str = _spec(choices=("embedded", "synthetic", "file"))
  dataset_path: str
  dataset_format: str = _spec(choices=("auto", "text", "jsonl", "parquet", "arrayrecord"))
  dataset_text_field: str
  tokenizer_type: str = _spec(choices=("byte", "huggingface", "sentencepiece"))
  tokenizer_path: str
  add_bos: bool
  add_eos: bool
  packing: bool
  shuffle: bool
  data_shuffle_seed: int = _spec(min=0)
  grain_worker_count: int = _spec(min=0)
  max_bad_records: int = _spec(min=0)
  max_target_length: int = _spec(min=2)
  per_device_batch_size: float = _spec(gt=0)
  gradient_accumulation_steps: int = _spec(min=1)
  data_shards: int = _spec(min=0)
  # ---- optimizer -----------------------------------------------------------------------------
  learning_rate: float = _spec(min=0)
  lr_schedule: str = _spec(choices=("cosine", "wsd", "constant"))
  warmup_steps: int = _spec(min=0)
  final_lr_fraction: float = _spec(min=0, max=1)
  wsd_decay_fraction: float = _spec(min=0, max=1)
  adam_b1: float = _spec(min=0, max=1)
  adam_b2: float = _spec(min=0, max=1)
  adam_eps: float = _spec(gt=0)
  weight_decay: float = _spec(min=0)
  max_grad_norm: float = _spec(min=0)
  z_loss_weight: float = _spec(min=0)
  loss_chunk_length: int = _spec(min=0)
  moe_aux_loss_weight: float = _spec(min=0)
  router_bias_update_rate: float = _spec(min=0)
  nonfinite_policy: str = _spec(choices=("halt", "skip"))
  max_nonfinite_skips: int = _spec(min=0)
  # ---- checkpoints ---------------------------------------------------------------------------
  enable_checkpointing: bool
  async_checkpointing: bool
  checkpoint_period: int = _spec(min=1)
  max_checkpoints_to_keep: int = _spec(min=1)
  load_parameters_path: str
  checkpoint_verify: bool
  checkpoint_fallback: bool
  checkpoint_save_timeout_s: float = _spec(gt=0)
  # ---- metrics -------------------------------------------------------------------------------
  enable_tensorboard: bool
  peak_tflops_per_device: float = _spec(min=0)
  # ---- mesh and sharding ---------------------------------------------------------------------
  mesh_axes: list
  ici_data_parallelism: int
  ici_fsdp_parallelism: int
  ici_context_parallelism: int
  ici_expert_parallelism: int
  ici_tensor_parallelism: int
  dcn_data_parallelism: int
  dcn_fsdp_parallelism: int
  dcn_context_parallelism: int
  dcn_expert_parallelism: int
  dcn_tensor_parallelism: int
  logical_axis_rules: list
  # ---- multi-host (jax.distributed) ----------------------------------------------------------
  coordinator_address: str
  num_processes: int = _spec(min=0)
  process_id: int = _spec(min=-1)
  distributed_init_timeout_s: int = _spec(min=1)
  distributed_heartbeat_timeout_s: int = _spec(min=1)

  # ---- derived values (properties, never stored) -----------------------------------------------
  def ici_parallelism(self) -> list[int]:
    return [getattr(self, f"ici_{a}_parallelism") for a in self.mesh_axes]

  def dcn_parallelism(self) -> list[int]:
    return [getattr(self, f"dcn_{a}_parallelism") for a in self.mesh_axes]

  def global_batch_size(self, num_devices: int) -> int:
    """Sequences per optimizer step (all micro-batches of all devices)."""
    return self.micro_batch_size(num_devices) * self.gradient_accumulation_steps

  def micro_batch_size(self, num_devices: int) -> int:
    return int(round(self.per_device_batch_size * num_devices))

  def as_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


FIELDS: dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(Config)}
