"""YAML in and out through libyaml's C scanner, parser and emitter where PyYAML was built with it
(its wheels are): the same safe loader and dumper — SafeLoader's constructor and resolver, only
YAML's standard tags, no Python objects — with the character-by-character work in C rather than
Python. A config file and its overrides are read on every start of the trainer and of each tool,
and every run writes its config back."""
from typing import Any

import yaml

SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
SAFE_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def safe_load(stream: Any) -> Any:
  """`yaml.safe_load(stream)` (a string or an open file), parsed by libyaml where present."""
  return yaml.load(stream, Loader=SAFE_LOADER)   # the safe loader: standard tags only


def safe_dump(data: Any, **options: Any) -> str:
  """`yaml.safe_dump(data, **options)` as a string, emitted by libyaml where present."""
  return yaml.dump(data, Dumper=SAFE_DUMPER, **options)
