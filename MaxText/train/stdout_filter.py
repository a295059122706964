"""Drops known noise lines that C++ libraries print straight to file descriptor 1.

Gloo (JAX's cross-process CPU collectives) prints "[Gloo] Rank i is connected to n peer ranks..."
with std::cout for every communicator it opens — dozens of lines per multi-process CPU run, with
no switch to turn them off. `StdoutFilter` puts a pipe behind fd 1 and a thread that forwards
every line except those to the real stdout, in order (Python's own prints go through the same
pipe). `stop()` puts the real stdout back and waits for the thread to drain the pipe.
"""
from __future__ import annotations

import os
import sys
import threading


class StdoutFilter:
  def __init__(self, drop_prefixes: tuple[bytes, ...]):
    self.drop_prefixes = drop_prefixes
    self._saved: int | None = None
    self._thread: threading.Thread | None = None

  @property
  def active(self) -> bool:
    return self._saved is not None

  def start(self) -> None:
    if self.active:
      return
    sys.stdout.flush()
    self._saved = os.dup(1)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 1)
    os.close(write_end)
    self._thread = threading.Thread(target=self._pump, args=(read_end, self._saved),
                                    name="stdout-filter", daemon=True)
    self._thread.start()

  def _pump(self, read_end: int, out: int) -> None:
    with os.fdopen(read_end, "rb", buffering=0) as pipe:
      for line in pipe:
        if not line.startswith(self.drop_prefixes):
          os.write(out, line)

  def stop(self, timeout_s: float = 5.0) -> None:
    """Real stdout back on fd 1; the lines still in the pipe are forwarded first."""
    if not self.active:
      return
    sys.stdout.flush()
    os.dup2(self._saved, 1)          # closes the pipe's last write end: the thread sees EOF
    self._thread.join(timeout_s)
    os.close(self._saved)
    self._saved = self._thread = None


GLOO = StdoutFilter((b"[Gloo] ",))
