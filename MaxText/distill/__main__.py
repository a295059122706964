r"""Distillation of a teacher into a student on train.py's data:

  python -m MaxText.distill configs/base.yml teacher_path=CKPT_T [load_parameters_path=CKPT_S] \
      [distill_loss=forward_kl|reverse_kl|jsd] [distill_beta=0.5] [distill_temperature=1.0] \
      [distill_alpha=0.5] [key=value ...]

Each step: the teacher (any family or size sharing the student's vocabulary; its architecture
from its checkpoint) and the student run forward on the step's rows, and the student is updated on
alpha x the divergence of its next-token distribution from the teacher's (at temperature T, times
T²) + (1 - alpha) x its cross-entropy on the data (MaxText/losses/distill.py; the heads chunk by
chunk over the sequence, `loss_chunk_length`). Without load_parameters_path the student starts
from the random init of its config's architecture (model_name, or the architecture keys).

The rest is train.py's (`train/loop.py: Trainer`, of which `DistillTrainer` is a kind): data
(documents or chat, `sft=true`), held-out eval_loss of the student (`eval_period`), samples,
LoRA, gradient accumulation, checkpoints and resume (the teacher is loaded again), SIGTERM → save →
exit 42, metrics (loss, distill_divergence, distill_ce per token), and the exit statuses (2 config:
a teacher whose vocabulary differs names teacher_path; 3 data; 4 checkpoint; 5 non-finite).
"""
from __future__ import annotations

import sys
from typing import Sequence

from MaxText.config import cli
from MaxText.runtime.exit_codes import exit_process


def main(argv: Sequence[str]) -> int:
  # the trainer (jax): after --help
  from MaxText.distill.trainer import DistillTrainer  # pylint: disable=import-outside-toplevel
  from MaxText.train.loop import main as train_main  # pylint: disable=import-outside-toplevel
  return train_main(argv, trainer_class=DistillTrainer)


if __name__ == "__main__":
  if cli.wants_help(sys.argv[1:]) or len(sys.argv) < 2:
    cli.print_help(cli.usage(__doc__, {}, "distill"))
    sys.exit(0)
  exit_process(main(sys.argv[1:]))
