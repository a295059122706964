"""Writes configs/base.yml from the schema (MaxText/config/schema.py): sections, comment blocks,
one line per key with its default and its doc, the logical-axis-rules table one row per line; and
MaxText/config/views_generated.py, the config views as the type checker reads them (one typed
field per key: MaxText/config/views_source.py).

  python -m MaxText.config.render            # rewrites both
  python -m MaxText.config.render --check    # exit 6 if either is not what it renders

tests/test_config.py and tests/test_config_views.py run the check, so an edit of the schema
without a re-render fails there.
"""
from __future__ import annotations

import json
import sys
from typing import Any

from MaxText.config.load import BASE_YML
from MaxText.config.schema import KEYS, in_base_yml
from MaxText.config.tools import exit_status_line, print_help, usage_head
from MaxText.config.views_source import VIEWS_PY
from MaxText.config.views_source import source as views_source

WIDTH = 100          # section rule width
COMMENT_COLUMN = 36  # where the inline doc starts

HEADER = """\
# Every config key, its default and one line on what it does. Rendered from the schema
# (MaxText/config/schema.py: each key's type, default, range and doc, declared once) by
# `python -m MaxText.config.render`: edit the schema, not this file.
# Precedence: this file < configs/models/<model_name>.yml < key=value.
"""


def _float(x: float) -> str:
  """YAML 1.1 floats (a dot in the mantissa, a sign in the exponent): 3.0e-3, 10000.0."""
  if x != 0 and (abs(x) < 1e-2 or abs(x) >= 1e6):
    mantissa, exponent = f"{x:.15e}".split("e")
    mantissa = mantissa.rstrip("0")
    if mantissa.endswith("."):
      mantissa += "0"
    return f"{mantissa}e{int(exponent):+d}"
  return repr(float(x))


def value_text(x: Any) -> str:
  if isinstance(x, bool):
    return "true" if x else "false"
  if isinstance(x, int):
    return str(x)
  if isinstance(x, float):
    return _float(x)
  return json.dumps(x)   # strings and flow lists are valid YAML as JSON


def _line(text: str, doc: str) -> str:
  if len(text) < COMMENT_COLUMN - 1:
    return f"{text.ljust(COMMENT_COLUMN)}# {doc}"
  return f"{text}  # {doc}"


def render() -> str:
  out = [HEADER]
  for name, spec in KEYS.items():
    if not in_base_yml(name):     # a family registered at run time (not of the repository)
      continue
    if spec.section:
      rule = f"# ---- {spec.section} "
      out.append(f"\n{rule}{'-' * (WIDTH - len(rule))}\n")
    if spec.note:
      out.extend(f"# {line}\n" for line in spec.note.split("\n"))
    if isinstance(spec.default, list) and spec.default and isinstance(spec.default[0], list):
      out.append(_line(f"{name}: [", spec.doc) + "\n")
      out.extend(f"  {value_text(row)},\n" for row in spec.default)
      out.append("]\n")
    else:
      out.append(_line(f"{name}: {value_text(spec.default)}", spec.doc) + "\n")
  return "".join(out)


def usage() -> str:
  return usage_head("render") + (__doc__ or "").strip() + "\n\n" + exit_status_line("render")


def main(argv: list[str]) -> int:
  if argv in (["-h"], ["--help"]):
    print_help(usage())
    return 0
  texts = {BASE_YML: render(), VIEWS_PY: views_source()}
  if argv == ["--check"]:
    stale = []
    for path, text in texts.items():
      with open(path, encoding="utf-8") as f:
        if f.read() != text:
          stale.append(path)
    for path in stale:
      print(f"{path} is stale: run python -m MaxText.config.render", file=sys.stderr)
    return 6 if stale else 0   # exit_codes.EXIT_CHECK_FAILED (that module imports checkpoint/)
  if argv:
    print(usage(), file=sys.stderr)
    return 2
  for path, text in texts.items():
    with open(path, "w", encoding="utf-8") as f:
      f.write(text)
    print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
