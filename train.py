"""Entry point: `python train.py configs/base.yml [key=value ...]` (see README.md)."""
import sys

from MaxText.train.loop import main

if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
