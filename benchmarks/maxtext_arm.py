"""MaxText 0.2.5's synthetic pre-training on this machine (the TPU lane's comparison arm; installed
by `source benchmarks/tpu_install.sh`), one JSON record: the medians of its tokens/s and TFLOP/s
per device after the warm-up steps, MFU against --peak-tflops, the step time, the exit status.

  python3 benchmarks/maxtext_arm.py --steps 12 [--warmup 5] [--peak-tflops 197] [--timeout S] \\
      [--work DIR] key=value ...      # MaxText's own keys, e.g. model_name=qwen3-0.6b

The same as `python3 benchmarks/tpu_rows.py maxtext ...` (benchmarks/tpu_rows.py says what runs
and what the record holds; `ours` there is our trainer's matching row).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tpu_rows import main  # noqa: E402  (this folder's module)

if __name__ == "__main__":
  sys.exit(main(sys.argv[1:], trainer="maxtext"))
