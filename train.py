"""Entry point: `python train.py configs/base.yml [key=value ...]` (see README.md; `--help`)."""
import os
import sys
import threading

from MaxText.train.usage import usage, wants_help

if __name__ == "__main__":
  if wants_help(sys.argv[1:]):
    base = next((a for a in sys.argv[1:] if a.endswith((".yml", ".yaml")) and os.path.isfile(a)),
                None)
    sys.stdout.write(usage(base) if base else usage())
    sys.exit(0)
  from MaxText.train.loop import main  # pylint: disable=g-import-not-at-top  (jax: after --help)
  code = main(sys.argv[1:])
  if any(t.is_alive() and not t.daemon for t in threading.enumerate()
         if t is not threading.main_thread()):
    # e.g. a checkpoint write stuck on hung storage (exit 4): do not wait for it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
  sys.exit(code)
