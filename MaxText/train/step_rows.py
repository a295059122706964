"""One training step's metrics row, built on the host once the step is read back: the step's own
metrics, each as the Python number of its dtype (an integer metric such as the batch checksum
stays an int, a floating one is a float), then the smoothed loss, the step's wall time, tokens/s,
TFLOP/s and MFU per device, and the process's resident memory."""
from __future__ import annotations

import time
from typing import Sequence

import jax
import psutil

from MaxText.metrics.writers import LossSmoother


def host_values(metrics: dict) -> dict:
  """{name: device scalar} → {name: Python int / float / bool of the scalar's dtype}; waits for
  the step that computes them."""
  return {k: v.item() for k, v in jax.device_get(metrics).items()}


class StepRows:
  """The rows of one run's steps, in order: a step's time runs from the previous row (or the
  start) to its own, less the time `exclude`d (evaluation, samples: no step's)."""

  def __init__(self, flops_per_step: float, peak_tflops: float, tokens_per_step: int,
               num_devices: int, peak_under_load: bool = False,
               earlier_losses: Sequence[float | None] = ()):
    self.flops_per_step, self.peak_tflops = flops_per_step, peak_tflops
    self.peak_under_load = peak_under_load
    self.tokens_per_step, self.num_devices = tokens_per_step, num_devices
    self._smoother = LossSmoother()
    self._smoother.replay(earlier_losses)   # a resumed run's average continues
    self._last_done = time.perf_counter()

  def exclude(self, seconds: float) -> None:
    self._last_done += seconds

  def row(self, metrics: dict) -> dict:
    """The row of the next step from its metrics (device values: waits for the step)."""
    row = host_values(metrics)
    row["loss_smoothed"] = self._smoother.update(row["loss"])
    now = time.perf_counter()
    step_time, self._last_done = now - self._last_done, now
    tflops = self.flops_per_step / step_time / 1e12 / self.num_devices
    row.update(step_time_s=step_time, tokens_per_s=self.tokens_per_step / step_time,
               tflops_per_device=tflops,
               mfu=tflops / self.peak_tflops if self.peak_tflops > 0 else 0.0,
               rss_gib=psutil.Process().memory_info().rss / 2**30)
    if self.peak_under_load:   # the MFU is against a peak measured on a busy machine
      row["mfu_peak_under_load"] = True
    return row
