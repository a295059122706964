"""Entry point: `python train.py configs/base.yml [key=value ...]` (see README.md; `--help`)."""
import os
import sys

from MaxText.config.tools import print_help
from MaxText.train.usage import usage, wants_help

if __name__ == "__main__":
  if wants_help(sys.argv[1:]):
    base = next((a for a in sys.argv[1:] if a.endswith((".yml", ".yaml")) and os.path.isfile(a)),
                None)
    print_help(usage(base) if base else usage())
    sys.exit(0)
  # pylint: disable-next=g-import-not-at-top
  from MaxText.config.load import ConfigError, load_config
  from MaxText.resolve.hf_config import read_hf_config
  from MaxText.runtime.exit_codes import EXIT_CONFIG, exit_process
  from MaxText.storage import paths
  # the trainer's first checks (MaxText/train/loop.py: build), here before jax is imported: a key
  # train.py does not read, a bad value or an hf_path without a config.json is refused at once
  try:
    cfg = load_config(sys.argv[1:], keep_auto=True, tool="train")
    if cfg.hf_path:
      read_hf_config(paths.absolute(cfg.hf_path))
  except ConfigError as e:
    print(f"config error: {e}", file=sys.stderr, flush=True)
    sys.exit(EXIT_CONFIG)
  from MaxText.train.loop import main   # jax: after --help and the config's own checks
  exit_process(main(sys.argv[1:]))
