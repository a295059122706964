"""Where the test suite's time goes, per test and per file: CPU seconds (this process's threads
and the subprocesses it waited for), wall seconds, XLA compilations and their seconds, persistent
compilation-cache hits, programs traced and lowered, and the load average when the test ended.
CPU seconds hardly change with the machine's load, wall seconds do: on a shared machine compare
the CPU columns.

A compilation is one program handed to XLA (jax's `/jax/core/compile/backend_compile_duration`
event); a cache hit is one of those answered from the persistent compilation cache (the
`cache_hits` event inside it) instead of compiled, so `compiles` counts only real compilations
and `compile s` only their seconds. Each compiled program's identity is its persistent-cache key
(jax logs it on every miss): the same key compiled twice is the same program compiled twice, in
one process (a program the tests could have shared: another function object, another jit of the
same function) or in several files (one the cache answers on a warm run when it compiled in
`jax_persistent_cache_min_compile_time_secs` or more).

As a pytest plugin (one JSON line per test, one file per xdist worker):

  PYTHONPATH=benchmarks SUITE_PROFILE=/tmp/prof .venv/bin/python -m pytest -q -n 2 \\
      --dist loadfile tests -p suite_profile

and the summary, the costliest files first, then the programs compiled more than once and the
costliest programs:

  .venv/bin/python benchmarks/suite_profile.py /tmp/prof.*.jsonl
"""
import collections
import json
import logging
import os
import re
import sys
import time

import pytest

_counts = collections.Counter()
_programs: list[list] = []            # [name, seconds, key or None] of this test's compilations
_pending = {"hit": False, "key": None}
_KEY = re.compile(r"PERSISTENT COMPILATION CACHE MISS for '(?P<name>[^']*)' with key '(?P<key>[^']*)'")


class _MissKeys(logging.Handler):
  """The persistent-cache key jax logs (at DEBUG) for every program it compiles."""

  def emit(self, record):
    try:
      m = _KEY.match(record.getMessage())
    except Exception:   # pylint: disable=broad-except
      return
    if m:
      _pending["key"] = m.group("key")[-16:]


def _listen() -> None:
  import jax  # pylint: disable=import-outside-toplevel
  from MaxText.backend import compat  # pylint: disable=import-outside-toplevel

  def on_duration(event, secs, **kw):
    if event == "/jax/core/compile/backend_compile_duration":
      if _pending["hit"]:
        _counts["hits"] += 1
        _counts["hit_s"] += secs
      else:
        _counts["compiles"] += 1
        _counts["compile_s"] += secs
        _programs.append([kw.get("fun_name", "?"), round(secs, 3), _pending["key"]])
      _pending.update(hit=False, key=None)
    elif event == "/jax/core/compile/jaxpr_trace_duration":
      _counts["traces"] += 1
      _counts["trace_s"] += secs
    elif event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
      _counts["lowerings"] += 1
      _counts["lower_s"] += secs

  def on_event(event, **_):
    if event == "/jax/compilation_cache/cache_hits":
      _pending["hit"] = True

  jax.monitoring.register_event_duration_secs_listener(on_duration)
  jax.monitoring.register_event_listener(on_event)
  compiler_log = logging.getLogger(compat.COMPILER_LOGGER)
  compiler_log.addHandler(_MissKeys(logging.DEBUG))
  compiler_log.setLevel(logging.DEBUG)
  compiler_log.propagate = False   # the keys only reach the handler above, not the test's output


def pytest_configure(config):
  del config
  _listen()


FIELDS = ("compiles", "compile_s", "hits", "hit_s", "traces", "trace_s", "lowerings", "lower_s")


def _snapshot():
  t = os.times()
  return (t.user + t.system, t.children_user + t.children_system, time.monotonic(),
          dict(_counts))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  del nextitem
  _programs.clear()
  a = _snapshot()
  yield
  b = _snapshot()
  row = dict(id=item.nodeid, cpu=b[0] - a[0], child=b[1] - a[1], wall=b[2] - a[2],
             load=os.getloadavg()[0], programs=list(_programs),
             pid=os.getpid(), **{k: b[3].get(k, 0) - a[3].get(k, 0) for k in FIELDS})
  out = os.environ.get("SUITE_PROFILE", "suite_profile")
  with open(f"{out}.{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.jsonl", "a",
            encoding="utf-8") as f:
    f.write(json.dumps(row) + "\n")


def _rows(paths: list[str]):
  for path in paths:
    with open(path, encoding="utf-8") as f:
      for line in f:
        if line.strip():
          yield json.loads(line)


def summary(paths: list[str], top: int = 25) -> str:
  per = collections.defaultdict(collections.Counter)
  by_key = collections.defaultdict(lambda: {"name": "", "n": 0, "s": 0.0, "files": set(),
                                            "pids": collections.Counter()})
  by_test = []
  for r in _rows(paths):
    file = r["id"].split("::")[0]
    c = per[file]
    for k in ("cpu", "child", "wall", *FIELDS):
      c[k] += r.get(k, 0)
    c["tests"] += 1
    by_test.append((r["cpu"] + r["child"], r["compiles"], r["compile_s"], r["id"]))
    for name, secs, key in r.get("programs", []):
      if key is None:
        continue
      p = by_key[key]
      p["name"], p["n"], p["s"] = name, p["n"] + 1, p["s"] + secs
      p["files"].add(file)
      p["pids"][r.get("pid")] += 1
  lines = ["| file | tests | CPU s | children's CPU s | wall s | compiles | compile s | cache hits "
           "| hit s | lowerings | lower s | trace s |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  total = collections.Counter()
  for name, c in sorted(per.items(), key=lambda kv: -(kv[1]["cpu"] + kv[1]["child"])):
    total.update(c)
    lines.append(f"| {name} | {c['tests']} | {c['cpu']:.1f} | {c['child']:.1f} | {c['wall']:.1f} | "
                 f"{c['compiles']} | {c['compile_s']:.1f} | {c['hits']} | {c['hit_s']:.1f} | "
                 f"{c['lowerings']} | {c['lower_s']:.1f} | {c['trace_s']:.1f} |")
  lines.append(f"| all | {total['tests']} | {total['cpu']:.1f} | {total['child']:.1f} | "
               f"{total['wall']:.1f} | {total['compiles']} | {total['compile_s']:.1f} | "
               f"{total['hits']} | {total['hit_s']:.1f} | {total['lowerings']} | "
               f"{total['lower_s']:.1f} | {total['trace_s']:.1f} |")
  repeated = sorted((p for p in by_key.values() if p["n"] > 1), key=lambda p: -p["s"])
  lines += ["", "Programs compiled more than once (same persistent-cache key), the costliest first:",
            "| program | times | in one process (most) | seconds | files |", "|---|---|---|---|---|"]
  for p in repeated[:top]:
    lines.append(f"| {p['name']} | {p['n']} | {max(p['pids'].values())} | {p['s']:.1f} | "
                 f"{', '.join(sorted(f.split('/')[-1] for f in p['files']))} |")
  lines.append(f"| all repeated | {sum(p['n'] - 1 for p in repeated)} extra | | "
               f"{sum(p['s'] * (p['n'] - 1) / p['n'] for p in repeated):.1f} extra s | |")
  lines += ["", "Costliest tests (CPU s incl. children):", "| test | CPU s | compiles | compile s |",
            "|---|---|---|---|"]
  for cpu, n, secs, nodeid in sorted(by_test, reverse=True)[:top]:
    lines.append(f"| {nodeid} | {cpu:.1f} | {n} | {secs:.1f} |")
  return "\n".join(lines)


if __name__ == "__main__":
  print(summary(sys.argv[1:]))
