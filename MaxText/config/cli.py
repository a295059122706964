"""The one command line of every program: an optional config file, then `key=value` arguments.

A `key=value` is either one of the program's own arguments (`Arg`s: what is not a config key —
an output folder, a tool's mode) or a config key of the schema (MaxText/config/schema.py: its one
declaration, type and default). A config key the program does not read (the schema's `tools`) is
refused, like an unknown one (exit 2, naming it and the programs that read it). `-h` / `--help`
prints the program's usage (its module docstring, with examples), its arguments and the config
keys it reads with their defaults, and exits 0.

  parsed = parse(argv, {"output_path": Arg(help="...")}, __doc__, tool="to_maxtext")
  if parsed is None:    # -h / --help: the usage was printed
    return 0
  args, cfg, config_argv = parsed
"""
from __future__ import annotations

import difflib
import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from MaxText.config.load import BASE_YML, ConfigError, load_config, parse_overrides
from MaxText.config.render import value_text
from MaxText.config.schema import KEYS, Config
from MaxText.config.tools import TOOLS, exit_status_line, print_help, usage_head

REQUIRED = object()
HELP_FLAGS = ("-h", "--help")


@dataclass(frozen=True)
class Arg:
  type: Callable[[str], Any] = str   # a type, or a parser such as `boolean`
  default: Any = REQUIRED
  help: str = ""


def wants_help(argv: Sequence[str]) -> bool:
  return any(a in HELP_FLAGS for a in argv)


def boolean(text: str) -> bool:
  """An Arg type: true / false (1 / 0)."""
  if text.lower() not in ("true", "false", "1", "0"):
    raise ValueError(text)
  return text.lower() in ("true", "1")


boolean.__name__ = "bool"


def names(text: str) -> tuple[str, ...]:
  """An Arg type: comma-separated names ("" = none)."""
  return tuple(t for t in text.split(",") if t)


names.__name__ = "names"


def split_command(argv: Sequence[str]) -> tuple[list[str], list[str]]:
  """A launcher's own `key=value` arguments, and the command after `--` it runs (unparsed)."""
  argv = list(argv)
  if "--" not in argv:
    return argv, []
  i = argv.index("--")
  return argv[:i], argv[i + 1:]


def key_lines(tool: str, defaults: Mapping[str, Any] | None = None) -> list[str]:
  """Section headers and "  key = default    # description" lines of the config keys `tool` reads,
  in the schema's order; `defaults`: values that replace the schema's (a config file's); a table is
  shown as "[...]"."""
  out, section, shown = [], None, None
  for name, spec in KEYS.items():
    section = spec.section or section
    if tool not in spec.tools:
      continue
    if section != shown:
      out.append(f"\n{section}:")
      shown = section
    value = (defaults or {}).get(name, spec.default)
    table = isinstance(value, list) and value and isinstance(value[0], list)
    out.append(f"  {name} = {'[...]' if table else value_text(value)}    # {spec.doc}")
  return out


def usage(doc: str | None, spec: Mapping[str, Arg], tool: str) -> str:
  """The --help of `tool` (config/tools.py: PROGRAMS): the usage line, its module docstring (`doc`:
  the module's `__doc__`, None under -OO), its own arguments, its exit statuses, and the config
  keys it reads (a program of TOOLS)."""
  rows = []
  for name, arg in spec.items():
    what = "required" if arg.default is REQUIRED else f"default {arg.default!r}"
    rows.append(f"  {name}=<{arg.type.__name__}>".ljust(30) + f" {arg.help} ({what})")
  args = "\n\narguments:\n" + "\n".join(rows) if rows else ""
  text = usage_head(tool) + (doc or "").strip() + args + "\n\n" + exit_status_line(tool)
  if tool not in TOOLS:
    return text
  return (text + f"\n\nconfig keys {TOOLS[tool]} reads (key=value; the default as configs/base.yml "
          "has it; any other key is refused):" + "\n".join(key_lines(tool)))


def parse_own(argv: Sequence[str], spec: Mapping[str, Arg], doc: str | None, *,
              program: str) -> dict[str, Any] | None:
  """A launcher's own arguments (no config keys: its command after `--` has them); None after
  printing the usage of `program` (config/tools.py: PROGRAMS) for `-h` / `--help`."""
  if wants_help(argv):
    print_help(usage(doc, spec, program))
    return None
  values, rest = _typed(argv, spec)
  if rest:
    key = rest[0].partition("=")[0]
    close = difflib.get_close_matches(key, list(spec), n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise ConfigError(f"unknown argument '{key}'{hint} (the command and its config keys go "
                      "after --; --help for usage)")
  return _with_defaults(values, spec)


def _typed(argv: Sequence[str], spec: Mapping[str, Arg]) -> tuple[dict[str, Any], list[str]]:
  """({name: typed value} of the arguments `spec` declares, the other key=value arguments)."""
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
  return values, rest


def _with_defaults(values: dict[str, Any], spec: Mapping[str, Arg]) -> dict[str, Any]:
  missing = [k for k, arg in spec.items() if arg.default is REQUIRED and k not in values]
  if missing:
    raise ConfigError(f"missing argument(s): {', '.join(f'{k}=...' for k in missing)} "
                      f"(--help for usage)")
  return {k: values.get(k, arg.default) for k, arg in spec.items()}


def parse(argv: Sequence[str], spec: Mapping[str, Arg], doc: str | None, *, tool: str,
          config_file: bool = False) -> tuple[dict[str, Any], Config, list[str]] | None:
  """({name: typed value} of `spec`, the config, its argv [config file, key=value ...]). With
  `config_file`, a first argument without "=" is the config file (configs/base.yml otherwise).
  The config is `load_config`'s (dtype=auto resolved for the tools), every key set away from its
  default checked against what `tool` reads. None after printing the usage for `-h` / `--help`."""
  if wants_help(argv):
    print_help(usage(doc, spec, tool))
    return None
  base = BASE_YML
  if config_file and argv and "=" not in argv[0]:
    base, argv = argv[0], argv[1:]
  values, rest = _typed(argv, spec)
  for a in rest:
    key = a.partition("=")[0]
    if key not in KEYS:
      close = difflib.get_close_matches(key, [*spec, *KEYS], n=3, cutoff=0.6)
      hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
      raise ConfigError(f"unknown argument '{key}' (neither an argument of {TOOLS[tool]} nor a "
                        f"config key){hint} (--help for usage)")
  for key in parse_overrides(rest):
    if tool not in KEYS[key].tools:
      readers = ", ".join(TOOLS[t] for t in TOOLS if t in KEYS[key].tools)
      raise ConfigError(f"{key}: {TOOLS[tool]} does not read {key} (it is read by {readers}; "
                        "--help for what this program takes)")
  args = _with_defaults(values, spec)
  config_argv = [base, *rest]
  return args, load_config(config_argv, tool=tool), config_argv


def answer_early(argv: Sequence[str], spec: Mapping[str, Arg], doc: str | None, *, tool: str,
                 config_file: bool = False,
                 bad_input: tuple[type[Exception], ...] = (ConfigError,)) -> None:
  """The first thing a program does whose module is a library too, with jax imported at its top
  (refit, the converters): placed above those imports, it prints the usage for `-h` / `--help`
  (exit 0) and refuses a bad argument or config key (exit 2, "config error: ...", as the program's own
  `parse` under `reported` would) without waiting for jax; else it returns, and the program
  parses `argv` again."""
  try:
    if parse(argv, spec, doc, tool=tool, config_file=config_file) is None:
      sys.exit(0)
  except bad_input as e:
    print(f"config error: {e}", file=sys.stderr)
    sys.exit(2)


def require(cfg: Config, key: str, what: str) -> Any:
  """The value of config key `key`; ConfigError naming it when it is left at its empty default."""
  value = getattr(cfg, key)
  if value in ("", [], None):
    raise ConfigError(f"{key}: {what} is required ({key}=...; --help for usage)")
  return value
