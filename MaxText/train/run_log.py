"""The training run's lines on stdout / stderr: the run's own (process 0), each process's (tagged
"[process i/n]" in a multi-process run) and errors."""
from __future__ import annotations

import sys

import jax


def _tag() -> str:
  """"[process i/n] " in a multi-process run (never starts the runtime itself)."""
  if not jax.distributed.is_initialized() or jax.process_count() == 1:
    return ""
  return f"[process {jax.process_index()}/{jax.process_count()}] "


def log(msg: str) -> None:
  """The run's own lines (progress, summary): printed by process 0 only."""
  if jax.process_index() == 0:
    print(msg, flush=True)


def log_host(msg: str) -> None:
  """A line about this process (its devices, its data): printed by every process, tagged."""
  print(_tag() + msg, flush=True)


def log_error(msg: str) -> None:
  print(_tag() + msg, file=sys.stderr, flush=True)
