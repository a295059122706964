"""Preemption: SIGTERM or SIGINT asks the run to stop at a step every process agrees on.

One process: Python handlers for SIGTERM and SIGINT record the signal; the loop finishes the step
in flight, saves it, waits for the commit and exits 42. A second SIGINT interrupts at once
(KeyboardInterrupt). Several processes (`jax.distributed.initialize`): JAX's preemption service
receives SIGTERM and its preemption sync point (`reached_preemption_sync_point(step)`, what Orbax's
`CheckpointManager.reached_preemption` asks) is reached at the same step on every process, so no
Python SIGTERM handler is installed there.
"""
from __future__ import annotations

import signal
import threading
import time

import jax
from jax.experimental import multihost_utils


class PreemptionWatch:
  """Context manager installing the handlers (main thread only); restores the old ones on exit."""

  def __init__(self):
    self.signal_name: str | None = None
    self.received_at: float | None = None
    self._previous: dict[int, object] = {}

  def _handle(self, signum: int, frame) -> None:
    del frame
    if self.signal_name is not None and signum == signal.SIGINT:
      raise KeyboardInterrupt  # second Ctrl-C: stop now
    if self.signal_name is None:
      self.signal_name = signal.Signals(signum).name
      self.received_at = time.monotonic()

  def __enter__(self) -> "PreemptionWatch":
    if threading.current_thread() is not threading.main_thread():
      return self
    signums = [signal.SIGINT] + ([signal.SIGTERM] if jax.process_count() == 1 else [])
    for signum in signums:
      self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    self._previous.clear()

  def should_stop(self, step: int) -> bool:
    """True when every process should stop after `step` (call once per step on every process)."""
    if jax.process_count() > 1:
      try:
        return bool(multihost_utils.reached_preemption_sync_point(step))
      except RuntimeError:  # no preemption service (jax_enable_preemption_service off)
        return False
    return self.signal_name is not None
