"""Entry point: `python train.py configs/base.yml [key=value ...]` (see README.md)."""
import os
import sys
import threading

from MaxText.train.loop import main

if __name__ == "__main__":
  code = main(sys.argv[1:])
  if any(t.is_alive() and not t.daemon for t in threading.enumerate()
         if t is not threading.main_thread()):
    # e.g. a checkpoint write stuck on hung storage (exit 4): do not wait for it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
  sys.exit(code)
