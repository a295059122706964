"""The exit statuses of `train.py`: the contract orchestrators rely on (README "Exit status"); a
tool's `run()` mapped to them (`reported`), and the process ended with one (`exit_process`).

Anything not listed here (a Python traceback gives 1, a signal gives 128 + n) is a bug.
"""
import os
import sys
import threading
from typing import Callable

from MaxText.checkpoint.errors import CheckpointError

EXIT_OK = 0           # finished (or the run had already reached `steps`)
EXIT_CONFIG = 2       # bad config, refused before anything compiled
EXIT_DATA = 3         # bad data: missing/mismatched data iterator state, too many bad records
EXIT_CHECKPOINT = 4   # bad or incompatible checkpoint, or a save that failed or hung
EXIT_NONFINITE = 5    # non-finite loss or gradient: halted, nothing new saved
EXIT_CHECK_FAILED = 6  # a check that ran failed: logit_check's logits over the limits,
#                        render --check's stale configs/base.yml
EXIT_PREEMPTED = 42   # SIGTERM/SIGINT: the agreed step was saved and committed; restart to resume
# Ctrl-C twice (128 + SIGINT; a second SIGTERM: 143): stopped at once, the step in flight not saved;
# a rerun resumes from the last committed step
EXIT_INTERRUPTED = 130


def reported(run: Callable[[], int], bad_input: tuple[type[Exception], ...], *,
             data: tuple[type[Exception], ...] = (),
             checkpoint: tuple[type[Exception], ...] = (), label: str = "config error") -> int:
  """The exit status of a command-line tool's `run()`, never a traceback for bad input: an
  exception of `bad_input` is printed as "<label>: ..." (by default "config error: ...", the
  trainers' prefix too) and gives EXIT_CONFIG, one of `data` "data error: ..." and EXIT_DATA, a
  CheckpointError (or one of `checkpoint`) "checkpoint error: ..." and EXIT_CHECKPOINT. The classes
  are tried in that order, so a class in `bad_input` wins over a subclass of it in `data` or
  `checkpoint`."""
  try:
    return run()
  except bad_input as e:
    print(f"{label}: {e}", file=sys.stderr)
    return EXIT_CONFIG
  except data as e:
    print(f"data error: {e}", file=sys.stderr)
    return EXIT_DATA
  except (CheckpointError, *checkpoint) as e:   # damaged, or a LoRA checkpoint whose base changed
    print(f"checkpoint error: {e}", file=sys.stderr)
    return EXIT_CHECKPOINT


def exit_process(code: int) -> None:
  """Ends the process with `code`; without waiting for a non-daemon thread still alive (e.g. a
  checkpoint write stuck on hung storage, exit 4)."""
  if any(t.is_alive() and not t.daemon for t in threading.enumerate()
         if t is not threading.main_thread()):
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
  sys.exit(code)
