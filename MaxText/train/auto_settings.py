"""The config's `auto` values as a training run takes them (printed with the mesh).

  dtype=auto              bfloat16 compute (MaxText's default; master weights stay weight_dtype,
                          fp32 by default); the tools resolve it to float32 instead
                          (`MaxText.config.load.resolve_dtype`).
  loss_chunk_length=-1    chunks of AUTO_CHUNK_LENGTH positions when the family has a separate LM
                          head (`logits`), the vocabulary is at least AUTO_CHUNK_VOCAB_RATIO x
                          the model width (the fp32 logits then dwarf the hidden states) and the
                          sequence is longer than one chunk; else the whole sequence (0).

Why these values: benchmarks/RESULTS.md, "The default run: bf16 and the chunked loss by default"
(the README run's and the tiny config's steps A/B in one process).
"""
from __future__ import annotations

import dataclasses

from MaxText.config.load import resolve_dtype
from MaxText.config.schema import AUTO, AUTO_LOSS_CHUNK, Config
from MaxText.models.registry import get_family

# Positions per loss chunk when loss_chunk_length=-1 (measured: RESULTS.md).
AUTO_CHUNK_LENGTH = 128
# ... applied when vocab_size >= this x emb_dim: measured, the chunks cost ~2 % more CPU at a
# vocabulary of 1.5 x the width (the README model: 384 / 256) and save ~4 % at 32 x (8192 / 256)
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


def for_training(cfg: Config) -> Config:
  """`cfg` with dtype and loss_chunk_length concrete, as a training run uses them."""
  cfg = resolve_dtype(cfg, training=True)
  return dataclasses.replace(cfg, loss_chunk_length=loss_chunk(cfg))


def describe(given: Config, used: Config) -> str:
  """"; compute bfloat16 (dtype=auto), weights float32; loss in chunks of 128 positions
  (loss_chunk_length=-1: auto)" — what the run computes in and where an auto value came from."""
  dtype = f"compute {used.dtype}" + (f" ({'dtype=' + AUTO}; dtype=float32 for full precision)"
                                     if given.dtype == AUTO else "")
  chunk = (f"loss in chunks of {used.loss_chunk_length} positions" if used.loss_chunk_length
           else "loss over the whole sequence")
  if given.loss_chunk_length == AUTO_LOSS_CHUNK:
    chunk += " (loss_chunk_length=-1: auto)"
  return f"{dtype}, weights {used.weight_dtype}; {chunk}"
