"""The config's `auto` values as a training run takes them (printed with the mesh).

  dtype=auto              bfloat16 compute (MaxText's default; master weights stay weight_dtype,
                          fp32 by default); the tools resolve it to float32 instead
                          (`MaxText.config.load.resolve_dtype`).
  matmul_precision=auto   highest when the compute dtype is float32 (a float32 matmul is float32 on
                          every platform), else default (MaxText's default); the model is traced
                          at it (`ModelDef.traced`: jax.default_matmul_precision).
  remat_policy=auto       resolved by the Trainer, once its state's size is known: the fastest
                          policy whose memory estimate fits (train/memory_plan.py).
  loss_chunk_length=-1    chunks of AUTO_CHUNK_LENGTH positions when the family has a separate LM
                          head (`logits`), the vocabulary is at least AUTO_CHUNK_VOCAB_RATIO x
                          the model width (the fp32 logits then dwarf the hidden states) and the
                          sequence is longer than one chunk; else the whole sequence (0).

Why these values: benchmarks/RESULTS.md, "The CPU settings, A/B in one process" (the README
run's and the tiny config's steps).

A run resolves them once (`for_training` → `Training`: the concrete config and which keys were
auto); the config checks, the Trainer, the mesh line and config.yml all read that one result. The
checks need no "set by the user" flag: an auto chunk is never > 0 for a family without a head, so
a chunk > 0 there is always the user's.
"""
from __future__ import annotations

import dataclasses

from MaxText.config.load import resolve_dtype
from MaxText.config.schema import AUTO, AUTO_LOSS_CHUNK, Config
from MaxText.models.registry import get_family

# Positions per loss chunk when loss_chunk_length=-1.
AUTO_CHUNK_LENGTH = 128
# ... applied when vocab_size >= this x emb_dim: the chunks cost more than they save where the
# logits are not much larger than the hidden states (the README model: 384 / 256) and save where
# they dwarf them (the tiny config: 8192 / 256); the A/B is in RESULTS.md
AUTO_CHUNK_VOCAB_RATIO = 8


def has_logits_head(decoder_block: str) -> bool:
  """Whether the family applies its LM head separately (`build(...).logits`), so the loss can run
  it chunk by chunk."""
  return hasattr(get_family(decoder_block).build, "logits")


def loss_chunk(cfg: Config) -> int:
  """loss_chunk_length as the step runs it (0 = whole sequence)."""
  if cfg.loss_chunk_length != AUTO_LOSS_CHUNK:
    return cfg.loss_chunk_length
  if (has_logits_head(cfg.decoder_block) and cfg.max_target_length > AUTO_CHUNK_LENGTH
      and cfg.vocab_size >= AUTO_CHUNK_VOCAB_RATIO * cfg.emb_dim):
    return AUTO_CHUNK_LENGTH
  return 0


@dataclasses.dataclass(frozen=True)
class Training:
  """A config as a training run uses it: `cfg` with every auto value concrete, `auto` the keys
  the user left at auto (for the mesh line)."""
  cfg: Config
  auto: frozenset[str]
  remat_note: str = ""   # remat_policy=auto: which policy and why (the Trainer's memory plan)


def for_training(cfg: Config | Training) -> Training:
  """`cfg` with dtype, matmul_precision and loss_chunk_length concrete, as a training run uses them (a `Training`
  is returned as it is: resolved once, by train.py's `run`)."""
  if isinstance(cfg, Training):
    return cfg
  auto = frozenset(key for key, value in (("dtype", AUTO), ("matmul_precision", AUTO),
                                          ("loss_chunk_length", AUTO_LOSS_CHUNK))
                   if getattr(cfg, key) == value)
  used = resolve_dtype(cfg, training=True)
  return Training(dataclasses.replace(used, loss_chunk_length=loss_chunk(used)), auto)


def describe(training: Training) -> str:
  """"compute bfloat16 (dtype=auto; dtype=float32 for full precision), matmul precision default
  (matmul_precision=auto), weights float32; loss in chunks of 128 positions (loss_chunk_length=-1:
  auto)" — what the run computes in and where an auto value came from."""
  used = training.cfg
  dtype = f"compute {used.dtype}" + (f" ({'dtype=' + AUTO}; dtype=float32 for full precision)"
                                     if "dtype" in training.auto else "")
  dtype += f", matmul precision {used.matmul_precision}" + (
      " (matmul_precision=auto)" if "matmul_precision" in training.auto else "")
  chunk = (f"loss in chunks of {used.loss_chunk_length} positions" if used.loss_chunk_length
           else "loss over the whole sequence")
  if "loss_chunk_length" in training.auto:
    chunk += " (loss_chunk_length=-1: auto)"
  remat = f"; {training.remat_note}" if training.remat_note else ""
  return f"{dtype}, weights {used.weight_dtype}; {chunk}{remat}"
