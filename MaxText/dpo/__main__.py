r"""Preference optimization on pairs of responses (DPO and its variants, ORPO, SimPO):

  python -m MaxText.dpo configs/dpo.yml load_parameters_path=CKPT preferences=prefs.jsonl \
      [dpo_loss=sigmoid|ipo|hinge|robust|orpo|simpo] [beta=0.1] [key=value ...]

Each line of the preferences file: {"prompt": ..., "chosen": ..., "rejected": ...} as text, or as
chat messages (TRL's conversational format) rendered with the tokenizer's chat template; the loss
counts the responses' tokens only (MaxText/dpo/data.py). Each step: per_device_batch_size x
devices x gradient_accumulation_steps pairs, chosen and rejected run through the model together,
the loss of `dpo_loss` (MaxText/losses/preference.py: TRL's formulas) against the reference — the loaded checkpoint: with
LoRA the base under the adapters, else a frozen copy, or its log-probabilities computed once
(precompute_ref_log_probs=true) or read (reference_logps=DIR); ORPO and SimPO have none — and one optimizer
update (MaxText/dpo/step.py). Logged per step: loss, rewards/chosen, rewards/rejected,
rewards/margins, rewards/accuracies, logps/chosen, logps/rejected (and nll_loss with orpo);
eval_preferences: the same of held-out pairs (eval/...) before the first step, every
eval_preferences_period steps and after the last.

The rest is train.py's machinery (`train/loop.py: Trainer`, of which `DPOTrainer` is a kind): config
(base.yml + configs/dpo.yml + key=value; architecture and tokenizer from the checkpoint), mesh,
LoRA, gradient accumulation, checkpoints every `checkpoint_period` steps and at the end (a rerun
resumes: the pairs of a step are a function of (seed, step)), SIGTERM → save → exit 42,
metrics.jsonl / TensorBoard / stdout, and the exit statuses (2 config, 3 a bad preference row —
naming the line and the field —, 4 checkpoint, 5 non-finite). The family's auxiliary loss (MoE
balancing) is not part of the preference loss.
"""
from __future__ import annotations

import sys
from typing import Sequence

from MaxText.config import cli
from MaxText.runtime.exit_codes import exit_process


def main(argv: Sequence[str]) -> int:
  # the trainer (jax): after --help
  from MaxText.dpo.trainer import DPOTrainer  # pylint: disable=import-outside-toplevel
  from MaxText.train.loop import main as train_main  # pylint: disable=import-outside-toplevel
  return train_main(argv, trainer_class=DPOTrainer)


if __name__ == "__main__":
  if cli.wants_help(sys.argv[1:]) or len(sys.argv) < 2:
    cli.print_help(cli.usage(__doc__, {}, "dpo"))
    sys.exit(0)
  exit_process(main(sys.argv[1:]))
