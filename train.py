"""Entry point: `python train.py configs/base.yml [key=value ...]` (see README.md; `--help`)."""
import os
import sys

from MaxText.train.usage import usage, wants_help

if __name__ == "__main__":
  if wants_help(sys.argv[1:]):
    base = next((a for a in sys.argv[1:] if a.endswith((".yml", ".yaml")) and os.path.isfile(a)),
                None)
    sys.stdout.write(usage(base) if base else usage())
    sys.exit(0)
  # pylint: disable-next=g-import-not-at-top  (jax: after --help)
  from MaxText.runtime.exit_codes import exit_process
  from MaxText.train.loop import main
  exit_process(main(sys.argv[1:]))
