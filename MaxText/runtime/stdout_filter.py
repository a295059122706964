"""Drops known noise lines that C++ libraries print straight to file descriptor 1.

Gloo (JAX's cross-process CPU collectives) prints "[Gloo] Rank i is connected to n peer ranks..."
with std::cout for every communicator it opens — dozens of lines per multi-process CPU run, with
no switch to turn them off. `StdoutFilter` puts a pipe behind fd 1 and a thread that forwards
everything except those messages to the real stdout, in order (Python's own prints go through the
same pipe). std::cout may write a message in pieces, and another thread's print can land between
them (a line "[Gloo] Rank 1 is connected to 1 peer ranks. [process 1/2] host ..." then "Expected
number ... : 1"): so the messages are cut out of each line by pattern, and a line is dropped only
when nothing but them was on it. `stop()` puts the real stdout back and waits for the thread to
drain the pipe.
"""
from __future__ import annotations

import os
import re
import sys
import threading


class StdoutFilter:
  def __init__(self, noise: bytes):
    self.noise = re.compile(noise)   # what to cut out of each line
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
        kept = self.noise.sub(b"", line)
        if kept.strip() or not line.strip():   # drop the lines that held only noise
          os.write(out, kept)

  def stop(self, timeout_s: float = 5.0) -> None:
    """Real stdout back on fd 1; the lines still in the pipe are forwarded first."""
    if self._saved is None or self._thread is None:   # (not active: both set by start)
      return
    sys.stdout.flush()
    os.dup2(self._saved, 1)          # closes the pipe's last write end: the thread sees EOF
    self._thread.join(timeout_s)
    os.close(self._saved)
    self._saved = self._thread = None


GLOO = StdoutFilter(rb"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. ?"
                    rb"|Expected number of connected peer ranks is : \d+")
