"""Training method → its objective (MaxText/methods/objective.py), keyed as families are
(MaxText/models/registry.py).

`METHOD_MODULES` is the one table of the methods in this repository: a method is its module
`MaxText/methods/<method>.py` (which defines `METHOD`) plus one line here; the module is imported
the first time the method is asked for. A method defined elsewhere (a test, a user's package)
calls `register(METHOD)` — undone by `unregister`. The trainers reach their objective only
through `objective(name, **settings)`; everything else of a step is the update builder's
(MaxText/train/update.py)."""
from __future__ import annotations

import dataclasses
import importlib
from typing import Callable

from MaxText.config.load import ConfigError
from MaxText.methods.objective import Objective

METHOD_MODULES: dict[str, str] = {
    "pretrain": "MaxText.methods.pretrain",    # train.py: pre-training, SFT, LoRA
    "distill": "MaxText.methods.distill",      # python -m MaxText.distill
    "dpo": "MaxText.methods.dpo",              # python -m MaxText.dpo: DPO and its variants, ORPO
    "grpo": "MaxText.methods.grpo",            # MaxText/rl: GRPO and its variants
}


@dataclasses.dataclass(frozen=True)
class Method:
  """A training method: its name, its objective (the class, built from the method's settings),
  and where it runs."""
  name: str
  objective: Callable[..., Objective]
  runs_in: str = ""


_METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
  _METHODS[method.name] = method
  return method


def unregister(name: str) -> None:
  _METHODS.pop(name, None)


def names() -> list[str]:
  return sorted(set(METHOD_MODULES) | set(_METHODS))


def get_method(name: str) -> Method:
  if name not in _METHODS and name in METHOD_MODULES:
    method = importlib.import_module(METHOD_MODULES[name]).METHOD
    if method.name != name:
      raise ValueError(f"{METHOD_MODULES[name]}.METHOD is named {method.name!r}, "
                       f"registered as {name!r}")
    register(method)
  if name not in _METHODS:
    raise ConfigError(f"method '{name}': unknown training method (known: {', '.join(names())})")
  return _METHODS[name]


def objective(name: str, **settings) -> Objective:
  """The objective of method `name` with `settings` (its class's fields)."""
  return get_method(name).objective(**settings)
