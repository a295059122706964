"""How a config key is declared: `key(default, doc, ...)` as the field of a frozen dataclass, and
`Spec`, what the schema keeps of it. The common keys are the fields of `schema.Config`; a model
family declares the keys only it reads the same way, in its own folder
(`MaxText/models/<family>/keys.py`: a dataclass `Keys`), and the schema composes them into the one
`Config` (`schema.add_keys`: `extend_dataclass` gives `Config` and its views the new fields in
place, `shrink_dataclass` takes them back; `KeyNames` are the schema's live name sets). Imports nothing of MaxText but the program
names (`tools`), so a family's key module depends on nothing above the config package.
"""
from __future__ import annotations

import collections.abc
import copy
import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, TypedDict

from MaxText.config.tools import TOOLS


class ModelUse(TypedDict):
  """`key` options that several keys share, given as `**options`: how the model reads them."""
  model: bool
  arch: bool


class Section(TypedDict):
  """`key` options of the first key of a section, given as `**options` (a family's keys.py)."""
  section: str
  section_tools: tuple[str, ...]


@dataclass(frozen=True)
class Spec:
  """What the schema says about one key (`KEYS[name]`)."""
  name: str
  type: type                # bool, int, float, str or list
  items: type | None        # element type of a list key (None: any)
  default: Any
  doc: str
  choices: tuple | None = None
  min: float | None = None
  max: float | None = None
  gt: float | None = None
  model: bool = False
  data: bool = False
  arch: bool = False
  carried: bool = False
  repeat: bool = False      # a list of strings given as key=a key=b on the command line
  section: str | None = None
  note: str | None = None
  tools: frozenset[str] = frozenset()
  family: str = ""          # the family whose keys.py declares it; "" = a key of the common schema


def key(default: Any, doc: str, *, choices: tuple | None = None, min: float | None = None,
        max: float | None = None, gt: float | None = None, model: bool = False,
        data: bool = False, arch: bool | None = None, carried: bool = False,
        repeat: bool = False, section: str | None = None, note: str | None = None,
        section_tools: tuple[str, ...] | None = None, tools: tuple[str, ...] | None = None) -> Any:
  """A field of `Config` (or of a family's `Keys`) with its schema entry (name and type are taken
  from the annotation). `section_tools` (with `section`): the programs that read the section's
  keys unless a key names its own `tools`. `repeat` (a list of strings): on the command line each
  `key=value` is one item, the key given again adds the next (`image=a.png image=b.png`)."""
  unknown = (set(section_tools or ()) | set(tools or ())) - set(TOOLS)
  if unknown:
    raise ValueError(f"unknown tools {sorted(unknown)} (MaxText/config/tools.py: {list(TOOLS)})")
  if (section is None) != (section_tools is None):
    raise ValueError("section and section_tools come together (the section's default readers)")
  meta = dict(default=default, doc=doc, choices=choices, min=min, max=max, gt=gt, model=model,
              data=data, arch=model if arch is None else arch, carried=carried, repeat=repeat,
              section=section,
              note=note, section_tools=section_tools, tools=tools)
  if isinstance(default, list):
    return field(default_factory=lambda: copy.deepcopy(default), metadata={"key": meta})
  return field(default=default, metadata={"key": meta})


def specs_of(cls: type, family: str = "", *, section: str | None = None,
             section_tools: tuple[str, ...] = ()) -> dict[str, Spec]:
  """The `Spec` of each `key(...)` field of the dataclass `cls`, in declaration order. `section`
  and `section_tools`: what the first field has when it names no section of its own (a family's
  block of keys always starts a section of configs/base.yml)."""
  hints = typing.get_type_hints(cls)
  out, readers = {}, ()
  for i, f in enumerate(dataclasses.fields(cls)):
    if "key" not in f.metadata:
      raise ValueError(f"{cls.__qualname__}.{f.name} is not declared with key(...)")
    hint = hints[f.name]
    kind, args = typing.get_origin(hint) or hint, typing.get_args(hint)
    meta = dict(f.metadata["key"])
    if i == 0 and meta["section"] is None and section is not None:
      meta["section"], meta["section_tools"] = section, tuple(section_tools)
    readers = meta.pop("section_tools") or readers
    meta["tools"] = frozenset(meta["tools"] or readers)
    out[f.name] = Spec(name=f.name, type=kind, items=args[0] if args else None, family=family,
                       **meta)
  return out


class KeyNames(collections.abc.Set):
  """The names of the keys whose `Spec` passes `test`, in the schema's order, read live from
  `keys` (the schema's `KEYS`, so they include the keys families add later); set operations give
  frozensets."""

  def __init__(self, keys: dict[str, Spec], test: Callable[[Spec], bool]):
    self._keys, self._test = keys, test

  def __iter__(self):
    return iter([k for k, s in self._keys.items() if self._test(s)])

  def __contains__(self, name: object) -> bool:
    return isinstance(name, str) and name in self._keys and self._test(self._keys[name])

  def __len__(self) -> int:
    return sum(1 for s in self._keys.values() if self._test(s))

  @classmethod
  def _from_iterable(cls, it):
    return frozenset(it)

  def __repr__(self) -> str:
    return f"KeyNames({list(self)})"


def copy_field(f: dataclasses.Field) -> dataclasses.Field:
  return field(default=f.default, default_factory=f.default_factory,  # pyright: ignore[reportReturnType]
               metadata=f.metadata)   # dataclasses' stubs type field() as the default's type


_GENERATED = ("__init__", "__repr__", "__eq__", "__hash__", "__match_args__",
              "__dataclass_fields__")
# class → (the names added, the class's generated attributes before): one entry per extension,
# so that `shrink_dataclass` can put back exactly what the last one replaced
_EXTENSIONS: dict[type, list[tuple[frozenset[str], dict[str, Any]]]] = {}


def _generated_state(cls: type) -> dict[str, Any]:
  return {a: cls.__dict__[a] for a in (*_GENERATED, "__annotations__") if a in cls.__dict__}


def _lend(cls: type, fields: list[tuple[str, Any, dataclasses.Field]]) -> None:
  """A fresh frozen dataclass of `fields` lends `cls` its generated attributes."""
  fresh = dataclasses.make_dataclass(cls.__name__, fields, frozen=True, kw_only=True)
  for attr in _GENERATED:
    if hasattr(fresh, attr):
      setattr(cls, attr, getattr(fresh, attr))


def extend_dataclass(cls: type, new: list[tuple[str, dataclasses.Field]]) -> None:
  """Adds the fields `new` (name, field) to the frozen dataclass `cls` in place, so that every
  module that imported `cls` sees them: a fresh dataclass of the old and the new fields lends `cls` its
  generated `__init__`, `__repr__`, `__eq__`, `__hash__` and field table (the class keeps its
  own methods, bases and frozenness). `shrink_dataclass` undoes it."""
  if not new:
    return
  _EXTENSIONS.setdefault(cls, []).append((frozenset(n for n, _ in new), _generated_state(cls)))
  old = [(f.name, f.type, copy_field(f)) for f in dataclasses.fields(cls)]
  _lend(cls, old + [(n, "Any", f) for n, f in new])
  cls.__annotations__ = {**cls.__annotations__, **{n: "Any" for n, _ in new}}
  for n, f in new:
    if f.default is not dataclasses.MISSING:
      setattr(cls, n, f.default)


def shrink_dataclass(cls: type, names: set[str] | frozenset[str]) -> None:
  """Removes the fields `names` that `extend_dataclass` added to `cls` (those it does not have are
  skipped). When they are the last extension's, the class gets back the very attributes it had
  before it (its `__init__`, field table, ... : the same objects); otherwise a fresh dataclass of
  the fields left lends it new ones."""
  names = frozenset(names) & {f.name for f in dataclasses.fields(cls)}
  if not names:
    return
  history = _EXTENSIONS.get(cls, [])
  if history and history[-1][0] == names:
    _, state = history.pop()
    for attr in (*_GENERATED, "__annotations__"):
      if attr in state:
        setattr(cls, attr, state[attr])
      elif attr in cls.__dict__:
        delattr(cls, attr)
  else:
    _EXTENSIONS.pop(cls, None)     # the states kept hold the fields removed here: not restorable
    _lend(cls, [(f.name, f.type, copy_field(f)) for f in dataclasses.fields(cls)
                if f.name not in names])
    cls.__annotations__ = {k: v for k, v in cls.__annotations__.items() if k not in names}
  for n in names:
    if n in cls.__dict__:
      delattr(cls, n)
