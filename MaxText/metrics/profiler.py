"""The step profiler (`profiler=xplane`, MaxText's keys): `profiler_steps` steps of a run, after
its first `skip_first_n_steps_for_profiler` ones (compilation, warm-up), traced with
`jax.profiler` into `<run dir>/profile/` — the XSpace file (`plugins/profile/<time>/<host>.xplane.pb`)
that TensorBoard's profile plugin and xprof read, and that `summarize` below reads without them:
each device's compiled ops per step, largest first, by XLA's category.

The trace holds those steps only: the state is waited for before it starts (the steps before it
finished) and after the last traced step (the trace ends with it); the steps between run as usual,
dispatched ahead of the host. On an object-store run directory the trace is written locally and
copied there when it ends.
"""
from __future__ import annotations

import collections
import dataclasses
import glob
import os
import re
import shutil
import tempfile
from typing import Any, Callable

from MaxText.storage import paths

PROFILE_DIR = "profile"
XPLANE_SUFFIX = ".xplane.pb"


@dataclasses.dataclass
class StepProfiler:
  """Traces steps `first` … `last` (1-based, inclusive) of a run into `out_dir`."""
  first: int
  last: int
  out_dir: str
  log: Callable[[str], None] = print
  _local: str | None = None

  @classmethod
  def from_config(cls, cfg: Any, run_dir: str, start: int,
                  log: Callable[[str], None] = print) -> "StepProfiler | None":
    """The run's profiler (None when `profiler` is off or no step is left to trace: a run resumed
    past the traced steps' window logs that)."""
    if not cfg.profiler:
      return None
    first = start + cfg.skip_first_n_steps_for_profiler + 1
    last = min(first + cfg.profiler_steps - 1, cfg.steps)
    if first > last:
      log(f"profiler: nothing traced (the run resumes at step {start + 1}; steps {first}-"
          f"{first + cfg.profiler_steps - 1} are past steps={cfg.steps})")
      return None
    return cls(first, last, paths.join(run_dir, PROFILE_DIR), log)

  def before_step(self, step: int, state: Any) -> None:
    if step != self.first:
      return
    import jax  # pylint: disable=import-outside-toplevel
    jax.block_until_ready(state)   # the steps before it end outside the trace
    try:
      local = (tempfile.mkdtemp(prefix="maxtext_profile_") if paths.is_url(self.out_dir)
               else self.out_dir)
      os.makedirs(local, exist_ok=True)
      jax.profiler.start_trace(local)
      self._local = local
    except Exception as e:  # noqa: BLE001 — a profile is never worth a run
      self.log(f"profiler: could not start the trace in {self.out_dir} ({type(e).__name__}: "
               f"{e}); the run goes on untraced")

  def after_step(self, step: int, state: Any) -> None:
    """Ends the trace after the last traced step, before that step is checkpointed or anything
    else follows it; a failure to write it is logged, never fatal (the step is not lost to it)."""
    if step != self.last or self._local is None:
      return
    import jax  # pylint: disable=import-outside-toplevel
    jax.block_until_ready(state)   # the last traced step ends inside the trace
    local, self._local = self._local, None
    try:
      jax.profiler.stop_trace()
      if local != self.out_dir:   # an object-store run directory: copy the trace there
        for path in glob.glob(os.path.join(local, "**", "*"), recursive=True):
          if os.path.isfile(path):
            paths.copy_file(path, paths.join(self.out_dir, os.path.relpath(path, local)))
        shutil.rmtree(local, ignore_errors=True)
    except Exception as e:  # noqa: BLE001 — a profile is never worth a run
      self.log(f"profiler: the trace of steps {self.first}-{self.last} was not written to "
               f"{self.out_dir} ({type(e).__name__}: {e}); the run goes on")
      return
    self.log(f"profiler: steps {self.first}-{self.last} traced to {self.out_dir} "
             f"(xplane; TensorBoard's profile plugin or xprof reads it, "
             f"`python benchmarks/tpu_profile.py summary {self.out_dir}` prints its ops)")


def xplane_files(root: str) -> list[str]:
  """The XSpace files under `root` (a run's profile directory, or any folder), newest last."""
  found = glob.glob(os.path.join(root, "**", f"*{XPLANE_SUFFIX}"), recursive=True)
  return sorted(found, key=os.path.getmtime)


@dataclasses.dataclass
class OpTotal:
  """One compiled op's time over the trace, on one device."""
  name: str
  category: str
  ns: float = 0.0
  count: int = 0
  flops: float = 0.0
  bytes_accessed: float = 0.0
  text: str = ""          # the op's HLO (its `long_name`), where the trace carries it
  source: str = ""        # the jax operation it came from (`tf_op` / `source`), where carried


@dataclasses.dataclass
class DeviceSummary:
  device: str
  steps: int              # the programs counted as steps (the largest module's runs)
  step_module: str
  step_ns: float          # the step program's own time per step (its "XLA Modules" events)
  ops: list[OpTotal]      # every op of the trace, largest total first

  def categories(self) -> dict[str, float]:
    """ns per step by category, largest first."""
    out = collections.defaultdict[str, float](int)   # (a Counter holds ints)
    for op in self.ops:
      out[op.category] += op.ns / max(self.steps, 1)
    return dict(sorted(out.items(), key=lambda kv: kv[1], reverse=True))


def _stats(event: Any) -> dict[str, Any]:
  try:
    return dict(event.stats)
  except Exception:  # noqa: BLE001 — an event without stats
    return {}


def _self_times(events: list[Any]) -> list[float]:
  """Each event's own time on its line: its duration less its direct children's (a `while` or a
  call around the ops it runs), so the ops' times add up to the line's busy time."""
  own = [float(ev.duration_ns) for ev in events]
  order = sorted(range(len(events)), key=lambda i: (events[i].start_ns, -events[i].duration_ns))
  stack: list[int] = []
  for i in order:
    start = events[i].start_ns
    while stack and events[stack[-1]].end_ns <= start:
      stack.pop()
    if stack:
      own[stack[-1]] -= events[i].duration_ns
    stack.append(i)
  return own


_INSTRUCTION = re.compile(r"^%?([\w.\-]+) = (.*)$", re.S)
_OPCODE = re.compile(r"\s([a-z][\w\-]*)\(")
_KINDS = {"kOutput": "fusion: matmul (output fusion)", "kLoop": "fusion: element-wise",
          "kInput": "fusion: reduction", "kCustom": "fusion: custom"}


def split_event_name(name: str) -> tuple[str, str]:
  """(the instruction's name, its HLO text) of an XLA op event: a TPU trace names each event by
  its whole instruction (`%fusion.12 = bf16[...] fusion(...), kind=kOutput, ...`), a CPU trace by
  the name alone."""
  m = _INSTRUCTION.match(name.strip())
  return (m.group(1), m.group(2)) if m else (name, "")


def category_of(name: str, stats: dict[str, Any], text: str = "") -> str:
  """What an op does: XLA's `hlo_category` where the trace carries it, else read from its HLO
  text (a fusion by its kind: a matmul's output fusion, element-wise, a reduction; a custom call
  by its kernel's name, e.g. a Pallas / Mosaic kernel; else the opcode), else from its name."""
  cat = stats.get("hlo_category")
  if isinstance(cat, str) and cat:
    return cat
  if text:
    m = _OPCODE.search(text)
    opcode = m.group(1) if m else ""
    if opcode == "fusion":
      kind = re.search(r"kind=(k\w+)", text)
      return _KINDS.get(kind.group(1), "fusion") if kind else "fusion"
    if opcode == "custom-call":
      return "kernel: " + re.sub(r"[.]\d+$", "", name)
    if opcode in ("copy", "transpose", "copy-start", "copy-done"):
      return "data formatting"
    if opcode:
      return opcode
  stem = name.split(".")[0].split(":")[0]
  for word, label in (("custom", "custom-call"), ("convolution", "convolution"),
                      ("dot", "convolution"), ("copy", "data formatting"),
                      ("transpose", "data formatting"), ("all-", "collective"),
                      ("reduce-scatter", "collective"), ("fusion", "fusion")):
    if word in stem:
      return label
  return stem or "other"


def summarize(xplane: Any, *, device_prefix: str = "/device:") -> list[DeviceSummary]:
  """Each accelerator plane of one XSpace (a file, or a `jax.profiler.ProfileData`) as a
  `DeviceSummary` (on a CPU-only trace, the host's XLA ops). Steps: the runs of the largest
  program of the trace (by its total time)."""
  from jax.profiler import ProfileData  # pylint: disable=import-outside-toplevel
  data = ProfileData.from_file(xplane) if isinstance(xplane, str) else xplane
  planes = [p for p in data.planes if p.name.startswith(device_prefix)]
  out = []
  for plane in planes or [p for p in data.planes if p.name.startswith("/host:CPU")]:
    lines = {line.name: line for line in plane.lines}
    modules = collections.defaultdict[str, float](int)   # ns by program (a Counter holds ints)
    runs: collections.Counter = collections.Counter()
    for line_name in ("XLA Modules",):
      if line_name in lines:
        for ev in lines[line_name].events:
          modules[ev.name] += ev.duration_ns
          runs[ev.name] += 1
    ops: dict[str, OpTotal] = {}
    run_ids: dict[str, set] = {}
    op_lines = [lines["XLA Ops"]] if "XLA Ops" in lines else [
        line for line in plane.lines if line.name.startswith("tf_XLA")]
    for line in op_lines:
      events = list(line.events)
      own = _self_times(events)
      for ev, ev_ns in zip(events, own):
        st = _stats(ev)
        if not planes and "hlo_op" not in st:   # a CPU trace: only the compiled ops' events
          continue
        if not planes:   # a CPU trace: the module's runs are its distinct run ids
          modules[st.get("hlo_module", "")] += ev_ns
          run_ids.setdefault(st.get("hlo_module", ""), set()).add(st.get("run_id"))
        name, text = split_event_name(ev.name)
        op = ops.get(name)
        if op is None:
          text = text or str(st.get("long_name", ""))
          op = ops[name] = OpTotal(name, category_of(name, st, text))
          op.text = text[:400]
          op.source = str(st.get("tf_op", st.get("source", "")))[:200]
        op.ns += ev_ns
        op.count += 1
        for key, attr in (("flops", "flops"), ("model_flops", "flops"),
                          ("bytes_accessed", "bytes_accessed")):
          val = st.get(key)
          if isinstance(val, (int, float)) and not getattr(op, attr):
            setattr(op, attr, float(val))
    for module, ids in run_ids.items():
      runs[module] = len(ids)
    step_module, step_ns, steps = "", 0.0, 1
    if modules:
      step_module, total = max(modules.items(), key=lambda kv: kv[1])
      steps = max(runs[step_module], 1)
      step_ns = total / steps
    out.append(DeviceSummary(plane.name, steps, step_module, step_ns,
                             sorted(ops.values(), key=lambda o: -o.ns)))
  return out


def report(summary: DeviceSummary, top: int = 30) -> str:
  """Markdown: the categories per step, then the `top` ops per step."""
  per = max(summary.steps, 1)
  total = sum(op.ns for op in summary.ops) / per
  lines = [f"{summary.device}: {summary.steps} step(s) of `{summary.step_module}`, "
           f"{summary.step_ns / 1e6:.2f} ms per step (ops {total / 1e6:.2f} ms)", "",
           "| category | ms / step | share |", "|---|---|---|"]
  for cat, ns in summary.categories().items():
    lines.append(f"| {cat} | {ns / 1e6:.3f} | {ns / max(total, 1):.1%} |")
  lines += ["", "| op | category | ms / step | runs / step | TFLOP/s | jax op / HLO |",
            "|---|---|---|---|---|---|"]
  for op in summary.ops[:top]:
    rate = (f"{op.flops * op.count / op.ns / 1e3:.0f}" if op.flops and op.ns else "")
    what = (op.source or op.text).replace("|", "/")[:160]
    lines.append(f"| {op.name} | {op.category} | {op.ns / per / 1e6:.3f} | "
                 f"{op.count / per:g} | {rate} | {what} |")
  return "\n".join(lines)
