"""The persistent compilation cache every program shares (`jax_cache_dir`), and what compiling
cost a phase of a tool's start (`CompileMeter`, for the start-up lines).

The cache is JAX's own: each entry's key is a hash of the program's HLO module, its compile
options (the XLA flags among them), the devices and the jax / jaxlib / XLA versions. Every config
key that changes a program changes its HLO (shapes, dtypes, the layer stack, the constants folded
into it), so a changed config compiles afresh and never loads a stale program; a key that changes
no program (a prompt, a path, a seed passed as an argument) reuses it, as it should.
"""
from __future__ import annotations

import os
from types import TracebackType

import jax

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
CACHE_HIT = "/jax/compilation_cache/cache_hits"
# programs that compile faster than this are not written (reading them back would cost as much),
# unless JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS says otherwise
MIN_COMPILE_SECONDS = 0.5


def use(cache_dir: str) -> str:
  """Points JAX's persistent compilation cache at `cache_dir` (~ expanded; "" leaves it off) and
  returns the line that says where it is. Call before the first compile of the process."""
  if not cache_dir:
    return 'compilation cache off (jax_cache_dir="")'
  path = os.path.abspath(os.path.expanduser(cache_dir))
  jax.config.update("jax_compilation_cache_dir", path)
  if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:   # the user's choice stands
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
  return (f"compilation cache {path} (jax_cache_dir; keyed by each program's HLO, XLA flags, "
          f"devices and versions: a changed config compiles afresh)")


class CompileMeter:
  """`with CompileMeter() as m:` ...; then `m.seconds` spent handing programs to XLA (compiled or
  loaded from the persistent cache), `m.programs` of them, `m.hits` loaded from the cache."""

  def __init__(self):
    self.seconds, self.programs, self.hits = 0.0, 0, 0

  def _duration(self, event: str, duration_secs: float, **_) -> None:
    if event == BACKEND_COMPILE:
      self.seconds += duration_secs
      self.programs += 1

  def _event(self, event: str, **_) -> None:
    if event == CACHE_HIT:
      self.hits += 1

  def __enter__(self) -> CompileMeter:
    jax.monitoring.register_event_duration_secs_listener(self._duration)
    jax.monitoring.register_event_listener(self._event)
    return self

  def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
               tb: TracebackType | None) -> None:
    jax.monitoring.unregister_event_duration_listener(self._duration)
    jax.monitoring.unregister_event_listener(self._event)

  def text(self) -> str:
    """'compile 3.1 s: 5 programs, 4 from the cache' (or 'no compile')."""
    if not self.programs:
      return "no compile"
    plural = "s" if self.programs != 1 else ""
    return (f"compile {self.seconds:.1f} s: {self.programs} program{plural}, "
            f"{self.hits} from the cache")
