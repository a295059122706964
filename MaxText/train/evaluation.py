"""Held-out evaluation: the mean next-token cross-entropy of the model on `eval_steps` batches of
held-out data (MaxText/data/eval_data.py) and its perplexity, computed by one compiled program per
run with the training batch sharding. During training every `eval_period` steps and after the last
(`eval_loss`, `eval_perplexity`, `eval_tokens` to stdout, metrics.jsonl and TensorBoard); on a
saved checkpoint by `python -m MaxText.evaluate`."""
from __future__ import annotations

import math
import time
from typing import Any, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from MaxText.config.schema import Config
from MaxText.data.batch import BATCH_KEYS
from MaxText.data.config import DataConfig
from MaxText.data.eval_data import EvalBatches, eval_source
from MaxText.data.tokenizers import Tokenizer
from MaxText.losses.token_loss import token_loss_sums
from MaxText.models.model_def import ModelDef
from MaxText.sharding.rules import Rules, rows_like, use_rules


def format_eval(step: int | None, result: dict[str, float]) -> str:
  where = f"eval after step {step}" if step is not None else "eval"
  return (f"{where} | eval_loss {result['eval_loss']:.4f} | perplexity "
          f"{result['eval_perplexity']:.4g} | {int(result['eval_tokens']):,} tokens | "
          f"{result['eval_time_s']:.2f} s")


class Evaluator:
  """Evaluates parameters (sharded as training's) on the held-out batches of this process's data
  shards; `run(params)` → {eval_loss, eval_perplexity, eval_tokens, eval_time_s}."""

  def __init__(self, cfg: Config, tokenizer: Tokenizer | None, model_def: ModelDef, mesh: Mesh,
               rules: Rules, batch_sharding: NamedSharding, global_batch: int,
               shard_ids: Sequence[int], num_shards: int, shard_batch: int,
               whole_dataset: bool = False):
    """`whole_dataset`: with neither eval_dataset_path nor eval_split_fraction, evaluate on every
    document of the dataset keys (`eval_data.eval_source`)."""
    dcfg, split = eval_source(DataConfig.from_config(cfg), cfg.eval_dataset_path,
                              whole_dataset=whole_dataset)
    self.batches = EvalBatches(dcfg, split, tokenizer, shard_ids, num_shards, shard_batch,
                               cfg.eval_steps)
    self.shape = (global_batch, cfg.max_target_length)
    self.batch_sharding = batch_sharding

    def sums(params, batch):
      with use_rules(mesh, rules):
        # the training loss without its z-loss, chunked as training is (loss_chunk_length)
        nll, _, n, _ = token_loss_sums(model_def, params, batch, z_loss_weight=0.0,
                                       chunk=cfg.loss_chunk_length)
      return nll, n

    self._sums = jax.jit(sums, out_shardings=NamedSharding(mesh, PartitionSpec()))

  def run(self, params: Any) -> dict[str, float]:
    t0 = time.perf_counter()
    nll = tokens = 0.0
    for host in self.batches:
      batch = {k: jax.make_array_from_process_local_data(
          self.batch_sharding if k in BATCH_KEYS else rows_like(self.batch_sharding, v.ndim), v,
          (self.shape[0], *v.shape[1:])) for k, v in host.items()}
      s, n = jax.device_get(self._sums(params, batch))
      nll, tokens = nll + float(s), tokens + float(n)
    loss = nll / tokens if tokens else float("nan")
    return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700.0)) if tokens else loss,
            "eval_tokens": tokens, "eval_time_s": time.perf_counter() - t0}
