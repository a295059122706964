"""A digest of the compiled train step (its optimized HLO without source locations), to show that
a change leaves the step XLA runs as it was: run it in two checkouts and compare the digests.

  .venv/bin/python benchmarks/step_digest.py --model tiny dtype=bfloat16
  (cd ../other && .venv/bin/python "$OLDPWD"/benchmarks/step_digest.py --model tiny dtype=bfloat16)

The models are ab_step.py's (`--model readme | tiny | gemma4 | qwen3-next`), on `--devices` fake
CPU devices (fsdp over them); key=value arguments override the config. The code compiled is that
of the working directory's checkout.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys


def body(hlo: str) -> str:
  """The HLO from its first computation on, without the file/line tables and their references
  (they change with any edit of the source, not the program)."""
  start = re.search(r"^(%|ENTRY)", hlo, re.M)
  text = hlo[start.start():] if start else hlo
  return re.sub(r",? ?(metadata=\{[^}]*\}|stack_frame_id=\d+)", "", text)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", default="tiny")
  ap.add_argument("--devices", type=int, default=2)
  ap.add_argument("--save", help="write the stripped HLO to this file too")
  ap.add_argument("overrides", nargs="*", help="key=value")
  args = ap.parse_args()
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={args.devices}").strip()
  root = os.getcwd()
  sys.path[:0] = [root, os.path.join(root, "benchmarks"), os.path.dirname(os.path.abspath(__file__))]
  import jax  # pylint: disable=import-outside-toplevel
  from ab_step import model_keys  # pylint: disable=import-outside-toplevel
  from MaxText.config.load import load_config  # pylint: disable=import-outside-toplevel
  try:   # (a checkout from before issue 29's package move has it in MaxText.train)
    from MaxText.resolve import auto_settings  # pylint: disable=import-outside-toplevel
  except ImportError:
    from MaxText.train import auto_settings  # pylint: disable=import-outside-toplevel
  from MaxText.train.loop import Trainer  # pylint: disable=import-outside-toplevel
  keys = {k.split("=", 1)[0]: k for k in [*model_keys(args.model, args.devices),
                                          "enable_checkpointing=false",
                                          f"ici_fsdp_parallelism={args.devices}", *args.overrides]}
  cfg = load_config([os.path.join(root, "configs", "base.yml"), *keys.values()], keep_auto=True)
  trainer = Trainer(auto_settings.for_training(cfg), jax.devices()[:args.devices])
  text = body(trainer.compile_step().as_text())
  if args.save:
    with open(args.save, "w", encoding="utf-8") as f:
      f.write(text)
  print(f"{hashlib.sha256(text.encode()).hexdigest()[:16]}  {args.model} x{args.devices} "
        f"{' '.join(args.overrides)} ({root})")


if __name__ == "__main__":
  main()
