"""Preemption: SIGTERM or SIGINT asks the run to stop at a step every process agrees on.

One process: Python handlers for SIGTERM and SIGINT record the signal; the loop finishes the step
in flight, saves it, waits for the commit and exits 42. A second SIGINT interrupts at once
(`StopNow`, a KeyboardInterrupt: the trainers' `main` prints its one line and exits 130, 128 + the
signal, as the second SIGTERM below). Several processes (`jax.distributed.initialize`): JAX's preemption service
receives SIGTERM and its preemption sync point (`reached_preemption_sync_point(step)`, what Orbax's
`CheckpointManager.reached_preemption` asks) is reached at the same step on every process, so no
Python SIGTERM handler is installed there.

A step or a save that never finishes would leave a stop request unanswered for ever: Python runs
signal handlers only when the main thread is back in the interpreter, which a hung XLA call or
collective never is. So a watcher thread also sees every signal (through `signal.set_wakeup_fd`,
written by the C-level handler whatever the main thread does): a second SIGTERM or SIGINT ends the
process `SECOND_SIGNAL_GRACE_S` seconds later (exit 128 + the signal, as if killed by it, nothing
saved) unless the main thread has left the run by then — the usual case for Ctrl-C, whose second
press raises `StopNow` in the main thread.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any, Callable

import jax
from jax.experimental import multihost_utils

SECOND_SIGNAL_GRACE_S = 3.0
# this process's calls of `should_stop` with several processes: the call counter JAX's preemption
# sync point is computed from (the same on every process, as every process asks once per step)
_SYNC_CALLS = 0


def second_signal_line(signum: int) -> str:
  """What a second stop signal prints (one line; the exit status is 128 + the signal)."""
  return (f"second stop signal ({signal.Signals(signum).name}): exiting now, without saving the "
          f"step in flight (exit {128 + signum})")


class StopNow(KeyboardInterrupt):
  """A second Ctrl-C: the run is left at once, the step in flight not saved. A KeyboardInterrupt, so
  that whatever lets Ctrl-C through lets it through; its text is `second_signal_line`."""

  def __init__(self, signum: int = signal.SIGINT):
    super().__init__(second_signal_line(signum))
    self.exit_status = 128 + signum


# what `signal.signal` returns and takes: a handler, SIG_DFL / SIG_IGN, or None (one not installed
# from Python)
SignalHandler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class PreemptionWatch:
  """Context manager installing the handlers (main thread only); restores the old ones on exit."""

  def __init__(self):
    self.signal_name: str | None = None
    self.received_at: float | None = None
    self._previous: dict[int, SignalHandler] = {}
    self._watcher: threading.Thread | None = None
    self._left = threading.Event()
    self._pipe: tuple[int, int] | None = None
    self._previous_wakeup_fd = -1

  def _handle(self, signum: int, frame) -> None:
    del frame
    if self.signal_name is not None and signum == signal.SIGINT:
      raise StopNow(signum)  # second Ctrl-C: stop now
    if self.signal_name is None:
      self.signal_name = signal.Signals(signum).name
      self.received_at = time.monotonic()

  def _watch(self, read_fd: int, signums: list[int]) -> None:
    """Counts the stop signals as they arrive (even while the main thread is stuck in C code).

    Reads until `__exit__`'s zero byte, so a signal that came in before the run was left is
    always announced, however late this thread gets to run; only the exit on a second signal is
    called off once the main thread has left."""
    seen = 0
    while True:
      try:
        data = os.read(read_fd, 64)
      except OSError:
        return
      if not data:
        return
      for signum in data:
        if signum == 0:
          return
        if signum not in signums:
          continue
        seen += 1
        name = signal.Signals(signum).name
        if seen == 1:
          print(f"{name} received: the run stops after the step in flight and saves it; send "
                f"{name} again to stop at once without saving", file=sys.stderr, flush=True)
        elif seen == 2 and not self._left.wait(SECOND_SIGNAL_GRACE_S):
          print(second_signal_line(signum), file=sys.stderr, flush=True)
          os._exit(128 + signum)

  def __enter__(self) -> "PreemptionWatch":
    if threading.current_thread() is not threading.main_thread():
      return self
    signums = [signal.SIGINT] + ([signal.SIGTERM] if jax.process_count() == 1 else [])
    for signum in signums:
      self._previous[signum] = signal.signal(signum, self._handle)
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    self._pipe = (read_fd, write_fd)
    self._previous_wakeup_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    self._left.clear()
    self._watcher = threading.Thread(target=self._watch, args=(read_fd, [int(s) for s in signums]),
                                     name="stop-signal-watcher", daemon=True)
    self._watcher.start()
    return self

  def __exit__(self, *exc) -> None:
    if self._pipe is not None:  # first, so every byte in the pipe is a signal this watch handled
      signal.set_wakeup_fd(self._previous_wakeup_fd)
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    self._previous.clear()
    if self._pipe is not None and self._watcher is not None:   # (set together by __enter__)
      self._left.set()
      read_fd, write_fd = self._pipe
      os.write(write_fd, b"\0")  # the end mark: the watcher reads up to it, then returns
      self._watcher.join()
      os.close(read_fd)
      os.close(write_fd)
      self._pipe = self._watcher = None

  def should_stop(self, step: int) -> bool:
    """True when every process should stop after `step` (call once per step on every process).

    Several processes: JAX's sync point is one more than the largest call counter any process had
    reported when the notice came, and is met only by a call with exactly that counter. The
    counter passed is this process's count of calls (1, 2, …), not `step`: a resumed run's first
    call would be step N + 1 while a notice that came before any call (a SIGTERM during the first
    step) sets the sync point to 1, which the steps would never meet."""
    del step
    if jax.process_count() > 1:
      global _SYNC_CALLS
      _SYNC_CALLS += 1
      try:
        return bool(multihost_utils.reached_preemption_sync_point(_SYNC_CALLS))
      except RuntimeError:  # no preemption service (jax_enable_preemption_service off)
        return False
    return self.signal_name is not None
