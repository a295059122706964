"""Per-step metrics sinks: a JSON-lines file, TensorBoard, and a stdout line.

``MetricsWriter.write(step, metrics)`` appends one JSON object per step to
``<run_dir>/metrics.jsonl`` (flushed line by line, so a crashed run keeps
everything it logged) and mirrors the numeric values as TensorBoard scalars
under ``<run_dir>/tensorboard/``.  Only the primary process writes files;
the others may still call every method, which then does nothing.

On an object store (`base_output_directory=gs://…`; no appends there) the rows are kept in memory
and the whole ``metrics.jsonl`` object is uploaded again at most every ``upload_period_s`` (30 s)
and on ``flush``/``close``: a run killed with -9 loses at most the rows of that period (rows after
its last checkpoint are recomputed anyway). TensorBoard's writer uploads its event file the same
way itself (tensorboardX's gs:// / s3:// writers).

Resuming: a writer opened with ``start_step=k`` (the step the run restored; 0 for a fresh
start) first moves the rows of ``metrics.jsonl`` for steps after k — written by the interrupted
run after its last checkpoint, and about to be recomputed — to ``metrics.superseded.jsonl``
(appended; unparseable lines too), so ``metrics.jsonl`` holds exactly one row per step; the
TensorBoard writer purges its events after k the same way (``purge_step``). The losses of the
rows it keeps (``earlier_losses``) let the resumed run's smoothed loss continue where the
interrupted one's was (`LossSmoother.replay`).

Expected keys (the trainer passes at least these): ``loss``, ``lr``,
``grad_norm``, ``step_time_s``, ``tokens_per_s``, ``tflops_per_device``,
``mfu`` (a fraction in 0..1, or None when the device peak is unknown; with
``mfu_peak_under_load`` true the line says that the peak was measured under load).
Steps count completed optimizer steps (1-based, as in ``metrics.jsonl``): step ``s`` of
``total_steps`` leaves ``total_steps - s`` steps to run.
"""

from __future__ import annotations

import io
import json
import math
import numbers
import sys
import time
from typing import Sequence

from MaxText.storage import paths

REQUIRED_KEYS = ("step", "loss", "lr", "grad_norm", "step_time_s", "tokens_per_s",
                 "tflops_per_device", "mfu")


def to_python_scalar(value):
  """Turn numpy/JAX scalars into plain ``int``/``float``; non-finite floats become None.

  Strings, bools and None are returned unchanged; anything else that
  ``float()`` accepts (e.g. a 0-d array) becomes a float.
  """
  if value is None or isinstance(value, (bool, str)):
    return value
  if isinstance(value, numbers.Integral):
    return int(value)
  if hasattr(value, "item") and getattr(value, "size", 1) == 1:
    value = value.item()
    if isinstance(value, (bool, int)):
      return value
  value = float(value)
  return value if math.isfinite(value) else None


def _format_duration(seconds: float) -> str:
  """``125`` -> ``2m05s``; ``3725`` -> ``1h02m05s``; ``7`` -> ``7s``."""
  seconds = int(round(max(seconds, 0.0)))
  hours, rest = divmod(seconds, 3600)
  minutes, secs = divmod(rest, 60)
  if hours:
    return f"{hours}h{minutes:02d}m{secs:02d}s"
  if minutes:
    return f"{minutes}m{secs:02d}s"
  return f"{secs}s"


def _short(x: float) -> str:
  """Three significant digits without switching to exponent notation below 1000."""
  if abs(x) >= 100:
    return f"{x:,.0f}"
  return f"{x:.3g}"


def format_line(step: int, metrics: dict, total_steps: int, extra: Sequence[str] = ()) -> str:
  """One human-readable line, e.g.

  ``step   12/300 | loss 3.4521 (avg 3.5102) | grad 1.23 | lr 1.0e-03 | 0.412 s |
  4,970 tok/s | 2.1 TFLOP/s/dev | MFU 12.3% | ETA 2m01s``

  (avg: ``loss_smoothed``, when given: see `LossSmoother`.)

  Fields whose key is missing (or None / non-finite) are left out, except
  the loss, which shows ``nan`` so a divergence is visible. `extra`: parts
  the model family adds after the learning rate (e.g. ``expert load 1.23``;
  empty ones are left out).
  """
  width = len(str(total_steps))
  parts = [f"step {step:>{width}d}/{total_steps}"]

  def get(key):
    value = metrics.get(key)
    if value is None:
      return None
    value = to_python_scalar(value)
    return value if isinstance(value, (int, float)) else None

  loss = get("loss")
  if "loss" in metrics:
    parts.append(f"loss {loss:.4f}" if loss is not None else "loss nan")
    if (smoothed := get("loss_smoothed")) is not None:
      parts[-1] += f" (avg {smoothed:.4f})"
  if (grad := get("grad_norm")) is not None:
    parts.append(f"grad {_short(grad)}")
  if (lr := get("lr")) is not None:
    parts.append(f"lr {lr:.1e}")
  parts.extend(p for p in extra if p)
  step_time = get("step_time_s")
  if step_time is not None:
    parts.append(f"{step_time:.3f} s")
  if (tok := get("tokens_per_s")) is not None:
    parts.append(f"{tok:,.0f} tok/s")
  if (tf := get("tflops_per_device")) is not None:
    parts.append(f"{_short(tf)} TFLOP/s/dev")
  if (mfu := get("mfu")) is not None:
    parts.append(f"MFU {100.0 * mfu:.1f}%" + (" (peak measured under load)"
                                               if metrics.get("mfu_peak_under_load") else ""))
  if step_time is not None and total_steps > 0:
    remaining = max(total_steps - step, 0)
    parts.append(f"ETA {_format_duration(remaining * step_time)}")
  return " | ".join(parts)


class LossSmoother:
  """Exponential moving average of the loss (time constant ~`horizon` steps), bias-corrected as
  Adam's moments so the first steps are not pulled towards 0; non-finite losses are left out."""

  def __init__(self, horizon: int = 20):
    self.beta = 1.0 - 1.0 / horizon
    self.ema = 0.0
    self.weight = 0.0

  def replay(self, losses) -> None:
    """Feeds the losses of earlier steps (a resumed run's rows; None for a non-finite one), so
    the average continues as if the run had not stopped."""
    for loss in losses:
      if isinstance(loss, (int, float)):
        self.update(float(loss))

  def update(self, loss: float) -> float | None:
    if math.isfinite(loss):
      self.ema = self.beta * self.ema + (1.0 - self.beta) * loss
      self.weight = self.beta * self.weight + (1.0 - self.beta)
    return self.ema / self.weight if self.weight > 0 else None


def summary_writer_class():
  """tensorboardX's SummaryWriter. tensorboardX imports torch whenever it is installed (seconds
  of a run's start-up) only to accept torch tensors, which we never pass: unless torch is loaded
  already, it is imported with torch hidden (`sys.modules["torch"] = None` reads as "not
  installed"), and torch stays importable afterwards."""
  if "torch" in sys.modules:
    from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
    _close_gcs_event_files_once()
    return SummaryWriter
  # (None in sys.modules blocks the import, as the import system documents; typeshed types the
  # values as modules only)
  sys.modules["torch"] = None  # pyright: ignore[reportArgumentType]
  try:
    from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
  finally:
    if sys.modules.get("torch", 0) is None:
      del sys.modules["torch"]
  _close_gcs_event_files_once()
  return SummaryWriter


def _close_gcs_event_files_once() -> None:
  """tensorboardX's gs:// event file (`record_writer.GCSRecordWriter`) uploads the whole file on
  `close()` and again from `__del__`, closed or not: a writer closed with the run then uploads
  once more whenever it is garbage-collected, with the client's retries (minutes) if the store has
  gone. Registered for gs:// in its place (its own `register_writer_factory`), a writer that
  remembers it was closed: `__del__` uploads only a file never closed."""
  from tensorboardX import record_writer  # pylint: disable=import-outside-toplevel

  class ClosedOnce(record_writer.GCSRecordWriter):
    closed = False

    def close(self):
      if not self.closed:
        self.closed = True   # first: a failed upload is not tried again from __del__
        super().close()

    def __del__(self):
      self.close()

  class Factory(record_writer.GCSRecordWriterFactory):
    def open(self, path):
      return ClosedOnce(path)

  record_writer.register_writer_factory("gs", Factory())


class MetricsWriter:
  """Writes per-step metrics to ``metrics.jsonl`` and (optionally) TensorBoard.

  Args:
    run_dir: directory of this run; created on the primary process.
    enable_tensorboard: also write scalars with tensorboardX.
    is_primary: only the primary process (``jax.process_index() == 0``)
      writes anything.
  """

  JSONL_NAME = "metrics.jsonl"
  SUPERSEDED_NAME = "metrics.superseded.jsonl"
  TENSORBOARD_DIR = "tensorboard"

  def __init__(self, run_dir: str, *, enable_tensorboard: bool, is_primary: bool,
               start_step: int = 0):
    self.run_dir = run_dir
    self.is_primary = is_primary
    self.jsonl_path = paths.join(run_dir, self.JSONL_NAME)
    self.superseded = 0   # rows moved to metrics.superseded.jsonl when opening
    self.superseded_steps: list[int] = []   # the steps of those rows (unparseable lines aside)
    self.earlier_losses: list[float | None] = []   # the kept rows' losses, in step order
    self._jsonl = None
    self._tb = None
    if not is_primary:
      return
    paths.makedirs(run_dir)
    self.superseded = self._supersede_after(start_step)
    self._jsonl = (ObjectLines(self.jsonl_path) if paths.is_url(self.jsonl_path)
                   else open(self.jsonl_path, "a", encoding="utf-8"))  # pylint: disable=consider-using-with
    if enable_tensorboard:
      SummaryWriter = summary_writer_class()  # pylint: disable=invalid-name

      # a resumed writer's file must not replace the one of a run interrupted the same second
      self._tb = SummaryWriter(logdir=paths.join(run_dir, self.TENSORBOARD_DIR), flush_secs=30,
                               purge_step=start_step + 1,
                               filename_suffix=f".from-step-{start_step}")

  def _supersede_after(self, start_step: int) -> int:
    """Moves the rows after `start_step` to metrics.superseded.jsonl; returns how many."""
    if not paths.exists(self.jsonl_path):
      return 0
    keep, drop = [], []
    for line in io.StringIO(paths.read_text(self.jsonl_path), newline="\n"):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
        step = row.get("step")
      except (ValueError, AttributeError):
        row, step = {}, None
      kept = isinstance(step, int) and step <= start_step
      (keep if kept else drop).append(line if line.endswith("\n") else line + "\n")
      if kept:
        self.earlier_losses.append(row.get("loss"))
      elif isinstance(step, int):
        self.superseded_steps.append(step)
    if drop:
      superseded = paths.join(self.run_dir, self.SUPERSEDED_NAME)
      earlier = paths.read_text(superseded) if paths.exists(superseded) else ""
      paths.write_text(superseded, earlier + "".join(drop))
      paths.write_text(self.jsonl_path, "".join(keep))
    return len(drop)

  def write(self, step: int, metrics: dict) -> None:
    """Record the metrics of one step (no-op on non-primary processes)."""
    if not self.is_primary:
      return
    if self._jsonl is None:
      raise ValueError(f"metrics of step {step} written after the writer of {self.run_dir} closed")
    record: dict[str, bool | str | int | float | None] = {"step": int(step)}
    for key, value in metrics.items():
      if key == "step":
        continue
      record[str(key)] = to_python_scalar(value)
    self._jsonl.write(json.dumps(record, allow_nan=False) + "\n")
    self._jsonl.flush()
    if self._tb is not None:
      for key, value in record.items():
        if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
          self._tb.add_scalar(key, value, global_step=int(step))

  format_line = staticmethod(format_line)

  def flush(self) -> None:
    """Push buffered TensorBoard events to disk (the jsonl is flushed line by line locally; on
    an object store uploaded now)."""
    if self._tb is not None:
      self._tb.flush()
    if isinstance(self._jsonl, ObjectLines):
      self._jsonl.upload()

  def close(self) -> None:
    """Flush and close the files; safe to call more than once."""
    if self._tb is not None:
      self._tb.close()
      self._tb = None
    if self._jsonl is not None:
      self._jsonl.close()
      self._jsonl = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
    return False


class ObjectLines:
  """`metrics.jsonl` on an object store: the file's lines in memory, the whole object uploaded
  again when `upload_period_s` has passed since the last upload, on `upload()` and on `close()`
  (an object cannot be appended to)."""

  def __init__(self, url: str, upload_period_s: float = 30.0):
    self.url = url
    self.upload_period_s = upload_period_s
    self._text = [paths.read_text(url)] if paths.exists(url) else []
    self._dirty = False
    self._last = time.monotonic()

  def write(self, text: str) -> None:
    self._text.append(text)
    self._dirty = True

  def flush(self) -> None:
    if time.monotonic() - self._last >= self.upload_period_s:
      self.upload()

  def upload(self) -> None:
    if self._dirty:
      self._text = ["".join(self._text)]
      paths.write_text(self.url, self._text[0])
      self._dirty = False
    self._last = time.monotonic()

  def close(self) -> None:
    self.upload()
