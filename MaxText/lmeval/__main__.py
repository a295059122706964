"""lm-evaluation-harness's command line (`lm_eval`) with our `maxtext` model registered: every
argument is lm-eval's own (`python -m MaxText.lmeval run --help`); `--model_args` of the maxtext
model are config keys (below) and `config`, `max_length`, `max_gen_toks`
(MaxText/lmeval/model.py).

  python -m MaxText.lmeval --model maxtext --model_args load_parameters_path=CKPT \\
      --tasks tiny_python --include_path end_to_end/data/lmeval --batch_size 8
  python -m MaxText.lmeval --model maxtext --model_args hf_path=HF_DIR,dtype=float32 \\
      --tasks my_task --include_path my_tasks/ --log_samples --output_path out/

Exit 0; 2 on a bad config or request (a key the model does not read, no parameters, no
tokenizer); 3 on bad data; 4 on a damaged checkpoint; lm-eval's own errors as lm-eval reports them.
"""
from __future__ import annotations

import sys
from typing import Sequence

from MaxText.config import cli
from MaxText.config.load import ConfigError
from MaxText.data.errors import DataError
from MaxText.decoding.errors import InferenceError
from MaxText.lmeval import register
from MaxText.runtime.exit_codes import EXIT_OK, reported


def main(argv: Sequence[str]) -> int:
  if list(argv) in ([], ["-h"], ["--help"]):
    cli.print_help(cli.usage(__doc__, {}, "lm_eval"))
    return EXIT_OK
  register()

  def run() -> int:
    from lm_eval.__main__ import cli_evaluate  # pylint: disable=import-outside-toplevel
    sys.argv = ["lm-eval", *argv]
    cli_evaluate()
    return EXIT_OK
  return reported(run, (ConfigError, InferenceError), data=(DataError,))


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
