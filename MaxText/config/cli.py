"""The one `key=value` command-line parser of the tools (the converters, logit_check): each declares
its arguments as `Arg`s; `-h` / `--help` prints the tool's usage (its module docstring, with
examples) and the argument table; a bad argument is a `ConfigError` naming it (exit 2).

  parsed = parse(argv, {"hf_path": Arg(help="..."), "seed": Arg(int, 0, "...")}, __doc__)
  if parsed is None:    # -h / --help: the usage was printed
    return 0
  args, overrides = parsed
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from MaxText.config.load import ConfigError, parse_overrides

REQUIRED = object()


@dataclass(frozen=True)
class Arg:
  type: type = str
  default: Any = REQUIRED
  help: str = ""


def usage(doc: str, spec: Mapping[str, Arg], overrides: bool) -> str:
  rows = []
  for name, arg in spec.items():
    what = "required" if arg.default is REQUIRED else f"default {arg.default!r}"
    rows.append(f"  {name}=<{arg.type.__name__}>".ljust(30) + f" {arg.help} ({what})")
  if overrides:
    rows.append("  <config key>=<value>".ljust(30) + " any key of configs/base.yml (see there)")
  return doc.strip() + "\n\narguments:\n" + "\n".join(rows)


def parse(argv: Sequence[str], spec: Mapping[str, Arg], doc: str, *, overrides: bool = False
          ) -> tuple[dict[str, Any], list[str]] | None:
  """({name: typed value}, the other key=value arguments) — those must be config keys and are only
  accepted with `overrides`. None after printing the usage when `-h` / `--help` was given."""
  if any(a in ("-h", "--help") for a in argv):
    print(usage(doc, spec, overrides))
    return None
  values: dict[str, Any] = {}
  rest = []
  for a in argv:
    key, eq, text = a.partition("=")
    if not eq:
      raise ConfigError(f"argument '{a}' is not key=value (--help for usage)")
    if key not in spec:
      rest.append(a)
      continue
    if key in values:
      raise ConfigError(f"{key} is given twice")
    try:
      values[key] = spec[key].type(text)
    except ValueError:
      raise ConfigError(f"{key}={text!r}: expected {spec[key].type.__name__}") from None
  if rest and not overrides:
    known = ", ".join(spec)
    raise ConfigError(f"unknown argument(s): {', '.join(a.split('=')[0] for a in rest)} "
                      f"(known: {known}; --help for usage)")
  parse_overrides(rest)   # config keys only: an unknown one is refused with a "did you mean"
  missing = [k for k, arg in spec.items() if arg.default is REQUIRED and k not in values]
  if missing:
    raise ConfigError(f"missing argument(s): {', '.join(f'{k}=...' for k in missing)} "
                      f"(--help for usage)")
  return {k: values.get(k, arg.default) for k, arg in spec.items()}, rest
