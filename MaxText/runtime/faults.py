"""Test-only fault injection, driven by one environment variable; inert when it is unset.

    MAXTEXT_FAULT="<kind>:<step>[@<process>][,<kind>:<step>[@<process>]...]"

kinds (each fires once, at the given step, in every process or only in process `@<process>` of a
multi-process run; tests/test_faults.py, tests/test_multiprocess.py and docs/reliability.md use them):
  kill_at_step    SIGKILL this process right after step N is dispatched (mid-step), once the
                  saves already started have committed (so the test knows the last good step)
  sigterm_at_step send SIGTERM to this process right after step N is dispatched (preemption), then
                  pause until every process has told JAX's preemption service its step (the
                  service's sync point is then fixed), at most 120 s; one process alone: 3 s.
                  The notice reaches the other processes asynchronously, and on a loaded machine a
                  tiny model's steps could otherwise run past the last step first (a fixed 3 s
                  pause was not enough at load 15)
  kill_in_save    SIGKILL inside the background write of step N's checkpoint (arrays in flight)
  before_commit   SIGKILL after every file of step N's checkpoint is written, just before commit
  save_error      the background write of step N's checkpoint fails with ENOSPC (disk full)
  save_hang       the background write of step N's checkpoint blocks (hung storage) until
                  `RELEASE` is set or 120 s pass, then fails

The hooks are called from three places only: the train loop (`after_dispatch`) and, through the
save hooks the train loop hands to its `RunCheckpoints` (this module), the manifest item of a
checkpoint (`during_save_write`, `before_commit`); the checkpoint package never imports this one.
"""
from __future__ import annotations

import errno
import os
import signal
import sys
import threading
import time
from typing import Callable

ENV = "MAXTEXT_FAULT"
KINDS = ("kill_at_step", "sigterm_at_step", "kill_in_save", "before_commit", "save_error",
         "save_hang")
RELEASE = threading.Event()  # ends an injected `save_hang` (in-process tests)


def _armed(kind: str, step: int) -> bool:
  spec = os.environ.get(ENV, "")
  for item in filter(None, (s.strip() for s in spec.split(","))):
    name, _, value = item.partition(":")
    value, at, process = value.partition("@")
    if name not in KINDS or not value.isdigit() or (at and not process.isdigit()):
      raise ValueError(f"{ENV}={spec!r}: '{item}' is not <kind>:<step>[@<process>] with kind in "
                       f"{KINDS}")
    if name == kind and int(value) == step and (not at or int(process) == _process_index()):
      return True
  return False


def _process_index() -> int:
  import jax  # pylint: disable=import-outside-toplevel
  return jax.process_index()


def _say(msg: str) -> None:
  print(f"[fault] {msg} (t={time.time():.3f})", file=sys.stderr, flush=True)


def _kill() -> None:
  sys.stdout.flush()
  sys.stderr.flush()
  os.kill(os.getpid(), signal.SIGKILL)


def after_dispatch(step: int, wait_for_saves: Callable[[], None]) -> None:
  if _armed("kill_at_step", step):
    wait_for_saves()
    _say(f"SIGKILL at step {step}")
    _kill()
  if _armed("sigterm_at_step", step):
    _say(f"SIGTERM at step {step}")
    os.kill(os.getpid(), signal.SIGTERM)
    _wait_for_preemption_sync()


def _wait_for_preemption_sync(timeout_s: float = 120.0) -> None:
  import jax  # pylint: disable=import-outside-toplevel
  from MaxText.backend import compat  # pylint: disable=import-outside-toplevel
  client = compat.distributed_client()
  if jax.process_count() == 1 or client is None:
    time.sleep(3.0)
    return
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    if len(client.key_value_dir_get(compat.PREEMPTION_COUNTERS_KEY)) >= jax.process_count():
      _say("every process has told the preemption service its step")
      return
    time.sleep(0.05)
  _say(f"the preemption service did not hear from every process within {timeout_s:.0f} s")


def during_save_write(step: int) -> None:
  if _armed("kill_in_save", step):
    _say(f"SIGKILL while writing checkpoint {step}")
    _kill()
  if _armed("save_error", step):
    _say(f"write error in checkpoint {step}")
    raise OSError(errno.ENOSPC, f"No space left on device (injected by {ENV})")
  if _armed("save_hang", step):
    _say(f"checkpoint {step} write hangs")
    RELEASE.wait(120)
    raise TimeoutError(f"injected hang of checkpoint {step} ended")  # never commits


def before_commit(step: int) -> None:
  if _armed("before_commit", step):
    _say(f"SIGKILL just before checkpoint {step} commits")
    _kill()
