"""`train.py --help` / `-h`: how to call it, examples, and every config key with its default and
its one-line description, read from base.yml itself (the keys, defaults and comments live there
only). Imports nothing heavy, so help comes back at once."""
from __future__ import annotations

import os
import re

HELP_FLAGS = ("-h", "--help")
DEFAULT_BASE_YML = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "configs", "base.yml")

HEAD = """\
usage: train.py CONFIG.yml [key=value ...]
       train.py --help

Trains the model CONFIG.yml (normally configs/base.yml) describes; each key=value overrides one
key below (model_name=X overlays configs/models/X.yml first). Rerunning the same command resumes
from the run's latest checkpoint; a second run with the same run_name while one is running is
refused. Keys are checked before anything compiles (a bad one exits 2 naming it).

examples:
  train.py configs/base.yml                      the default model on the embedded text (CPU is fine)
  train.py configs/base.yml model_name=qwen3-tiny steps=100 run_name=q3
  train.py configs/base.yml dataset_type=file dataset_path='data/*.jsonl' tokenizer_path=TOKENIZER_DIR
  train.py configs/base.yml load_parameters_path=CKPT run_name=ft
                                                 fine-tune a converted checkpoint (its architecture
                                                 and tokenizer come with it)
  XLA_FLAGS=--xla_force_host_platform_device_count=8 train.py configs/base.yml ici_fsdp_parallelism=8
                                                 8 fake CPU devices, parameters sharded 8 ways

exit status: 0 done, 2 bad config, 3 bad data, 4 bad checkpoint or failed save, 5 non-finite loss,
42 preempted (saved; rerun to resume). Output: <base_output_directory>/<run_name>/ (config.yml,
metrics.jsonl, tensorboard/, checkpoints/). More: README.md.
"""

_SECTION = re.compile(r"^# -+ (.*?) -*$")
_KEY = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*):\s*(.*?)\s*(?:#\s*(.*))?$")


def key_lines(base_yml: str) -> list[str]:
  """"section" headers and "  key = default   description" lines, in base.yml's order. A value
  spread over several lines (a list) is shown as "[...]"; a key without its own comment takes the
  comment block above it."""
  out, above = [], ""
  with open(base_yml, encoding="utf-8") as f:
    for line in f:
      line = line.rstrip("\n")
      if m := _SECTION.match(line):
        out.append(f"\n{m.group(1)}:")
        above = ""
      elif line.startswith("#"):
        above = f"{above} {line.lstrip('# ').strip()}".strip()
      elif not line.strip():
        above = ""
      elif m := _KEY.match(line):
        key, value, comment = m.group(1), m.group(2), (m.group(3) or above)
        shown = "[...]" if value in ("[", "") or (value.startswith("[") and not value.endswith("]"))\
            else value
        out.append(f"  {key} = {shown}" + (f"    # {comment}" if comment else ""))
        above = ""
  return out


def usage(base_yml: str = DEFAULT_BASE_YML) -> str:
  return HEAD + f"\nkeys and defaults ({os.path.relpath(base_yml)}):" + "\n".join(
      key_lines(base_yml)) + "\n"


def wants_help(argv: list[str]) -> bool:
  return any(a in HELP_FLAGS for a in argv)
