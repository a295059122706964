"""The programs a block of code hands to XLA, in order: `CompileLog` records one entry per program
compiled or loaded from the persistent compilation cache (jax's backend-compile event, which both
fire; a program found in a jitted function's in-memory cache fires none), with markers the test
puts between them."""
from __future__ import annotations

import collections

import jax

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


class CompileLog:
  """`with CompileLog() as log:` ... `log.mark("step")` ...; then `log.programs(after="step")`:
  the names of the programs handed to XLA (after the first such marker)."""

  def __init__(self):
    self.events: list[tuple[str, str]] = []   # ("program" | "mark", name)

  def _listen(self, event: str, secs: float, **kwargs) -> None:
    del secs
    if event == BACKEND_COMPILE:
      self.events.append(("program", str(kwargs.get("fun_name", "?"))))

  def __enter__(self) -> CompileLog:
    jax.monitoring.register_event_duration_secs_listener(self._listen)
    return self

  def __exit__(self, *exc) -> None:
    jax.monitoring.unregister_event_duration_listener(self._listen)

  def mark(self, label: str) -> None:
    self.events.append(("mark", label))

  def programs(self, *, before: str | None = None, after: str | None = None) -> list[str]:
    """Program names, all of them, or those before / after the first `label` marker."""
    marks = [i for i, (kind, name) in enumerate(self.events) if kind == "mark"
             and name in (before, after)]
    lo = marks[0] + 1 if after is not None and marks else 0
    hi = marks[0] if before is not None and marks else len(self.events)
    if (before or after) and not marks:
      raise AssertionError(f"no {before or after!r} marker: {self.events}")
    return [name for kind, name in self.events[lo:hi] if kind == "program"]

  def counts(self, **kw) -> dict[str, int]:
    return dict(collections.Counter(self.programs(**kw)))
