"""A stand-in Ray actor for test_rl_ray, in a module of its own: Ray's worker imports the module
that defines an actor's class, and this one imports nothing (test_rl_ray imports jax and the
library, seconds of CPU in each actor process)."""
import os
import time


class Peer:
  """A stand-in worker: `fail` raises at once (a survivor whose collective broke), `die` ends its
  process after `delay` seconds (a peer killed mid-step), `ok` answers."""

  def fail(self):
    raise RuntimeError("Gloo AllGather failed: Connection reset by peer")

  def die(self, delay: float):
    time.sleep(delay)
    os._exit(1)

  def ok(self):
    return 1
