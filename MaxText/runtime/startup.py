"""Where the time from the command to the first finished step (a tool: its first answer) goes:
one line, printed once.

    start-up 7.9 s to the first step: imports 3.1 | config + devices 0.6 | mesh 0.4 | data 0.3 |
    init 0.5 | compile 1.9 (cache) | metrics 0.1 | first batch 0.1 | first step 0.9
    start-up 6.2 s to the first answer: imports 3.0 | config 0.2 | model 1.1 | answer 1.9
    (compile 1.4 s: 3 programs, 3 from the cache)

The first run in a process counts from the process's start (interpreter and imports included);
a later run in the same process (tests) from its own start.
"""
from __future__ import annotations

import time

import psutil

_first_run = True


class StartupClock:
  def __init__(self, from_process_start: bool = True):
    global _first_run
    self.parts: list[tuple[str, float]] = []
    if _first_run and from_process_start:
      # the wall-clock age of the process, moved onto perf_counter's scale
      age = max(0.0, time.time() - psutil.Process().create_time())
      self.last = time.perf_counter() - age
      self.mark("imports")
      _first_run = False
    else:
      self.last = time.perf_counter()

  def mark(self, name: str) -> None:
    """Ends the phase `name` now."""
    now = time.perf_counter()
    self.parts.append((name, now - self.last))
    self.last = now

  def line(self, until: str = "the first step", note: str = "") -> str:
    """The phases so far, e.g. until="the first answer", note="(compile 1.4 s: ...)"."""
    total = sum(s for _, s in self.parts)
    return (f"start-up {total:.1f} s to {until}: "
            + " | ".join(f"{name} {s:.1f}" for name, s in self.parts) + (f" {note}" if note else ""))
