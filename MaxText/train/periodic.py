"""What a training run does between steps besides checkpoints: held-out evaluation every
`eval_period` steps and after the last (train/evaluation.py; its row goes to metrics.jsonl and
TensorBoard under the step), and samples every `sample_period` steps and after the last
(train/samples.py). `after_step(step, params)` is the loop's one call; it runs after the step's
checkpoint was handed to the checkpointer, and an evaluation or sample that fails (bad held-out
data, a prompt that cannot be read or decoded, ...) is logged on stderr and the run goes on: it
never costs a finished step or its checkpoint."""
from __future__ import annotations

import time
from typing import Any, Callable

import jax

from MaxText.metrics.writers import MetricsWriter
from MaxText.train.evaluation import Evaluator, format_eval
from MaxText.train.run_log import log_error
from MaxText.train.samples import Sampler


class Periodic:
  def __init__(self, trainer: Any, data_iter: Any, writer: MetricsWriter,
               log: Callable[[str], None]):
    cfg = trainer.cfg
    self.cfg, self.writer, self.log = cfg, writer, log
    tokenizer = data_iter.tokenizer
    self.evaluator = None
    if cfg.eval_period:
      self.evaluator = Evaluator(cfg, tokenizer, trainer.model_def, trainer.mesh, trainer.rules,
                                 trainer.batch_sharding, trainer.global_batch, data_iter.shard_ids,
                                 data_iter.num_shards, trainer.global_batch // data_iter.num_shards)
    self.sampler = Sampler(cfg, trainer.mcfg, trainer.mesh, trainer.rules, tokenizer)

  def due(self, step: int) -> bool:
    """Whether `after_step(step, …)` has anything to do."""
    last = step == self.cfg.steps
    return ((self.evaluator is not None and (step % self.cfg.eval_period == 0 or last))
            or self.sampler.due(step, last))

  def after_step(self, step: int, params: Any) -> float:
    """Evaluates and samples when due; returns the seconds it took."""
    cfg = self.cfg
    t0 = time.perf_counter()
    last = step == cfg.steps
    if self.evaluator is not None and (step % cfg.eval_period == 0 or last):
      try:
        result = self.evaluator.run(params)
      except Exception as e:  # pylint: disable=broad-except
        log_failure("evaluation", step, e)
      else:
        self.writer.write(step, result)
        self.log(format_eval(step, result))
    if self.sampler.due(step, last):
      try:
        text = self.sampler.text(step, params)   # every process decodes; process 0 prints
      except Exception as e:  # pylint: disable=broad-except
        log_failure("sample", step, e)
      else:
        if jax.process_index() == 0:
          self.log(text)
    return time.perf_counter() - t0


def log_failure(what: str, step: int, error: Exception) -> None:
  """The line of an evaluation or sample that failed after `step` (its checkpoint already handed
  off): what, why, and that the run goes on (also GRPO's evaluation, MaxText/rl/grpo.py)."""
  log_error(f"warning: the {what} after step {step} failed and was skipped ({type(error).__name__}: "
            f"{error}); training goes on and step {step}'s checkpoint (if due) is unaffected")
