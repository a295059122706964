"""The background writes a save started, so that a failed save is reported only once they ended.

Orbax waits for a step's commit futures one after another and stops at the first that fails: the
other items' writes (the array items' TensorStore writes on Orbax's threads) then go on with
nobody waiting for them. Reported as the save's failure, with the trainer exiting, they would
still be writing into the step's temporary directory while the next run (in this process, or one
that starts at once) removes that directory or saves the same step again.

Each handler that writes in the background records its futures here (`InFlight.add`), and
`RunCheckpoints` waits for every recorded write of the step (`InFlight.wait`, bounded by the
save's time limit) before it reports a failed save.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Iterable

import orbax.checkpoint as ocp


class InFlight:
  """The futures of the writes a handler started that have not been waited for since."""

  def __init__(self):
    self._lock = threading.Lock()
    self._futures: list[Any] = []

  def add(self, futures: Iterable[Any] | None) -> list[Any]:
    # (Orbax's async_save returns None when it started no background write)
    futures = list(futures or [])
    with self._lock:
      self._futures.extend(futures)
    return futures

  def wait(self, timeout_s: float) -> bool:
    """Waits until every recorded write ended (its error, if any, is not ours to report: the
    save's first error is); True when they all did within `timeout_s`, else those still running
    stay recorded."""
    deadline = time.monotonic() + max(0.0, timeout_s)
    with self._lock:
      futures, self._futures = self._futures, []
    for n, f in enumerate(futures):
      try:
        f.result(timeout=max(0.0, deadline - time.monotonic()))
      except TimeoutError:
        with self._lock:
          self._futures[:0] = futures[n:]
        return False
      except Exception:  # pylint: disable=broad-except
        pass
    return True


def wait_all(in_flight: Iterable[InFlight], timeout_s: float) -> bool:
  """`InFlight.wait` of every handler, within one shared `timeout_s`."""
  deadline = time.monotonic() + max(0.0, timeout_s)
  return all([f.wait(deadline - time.monotonic()) for f in in_flight])


class JsonItemHandler(ocp.JsonCheckpointHandler):
  """Orbax's JSON handler (the `meta` item), its background write recorded in `in_flight`."""

  def __init__(self):
    super().__init__()
    self.in_flight = InFlight()

  async def async_save(self, directory, *args, **kwargs):
    return self.in_flight.add(await super().async_save(directory, *args, **kwargs))


@ocp.args.register_with_handler(JsonItemHandler, for_save=True)
@dataclasses.dataclass
class JsonItemSave(ocp.args.JsonSave):
  pass


@ocp.args.register_with_handler(JsonItemHandler, for_restore=True)
@dataclasses.dataclass
class JsonItemRestore(ocp.args.JsonRestore):
  pass
