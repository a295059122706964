"""Where the test suite's time goes, per test and per file: CPU seconds (this process's threads
and the subprocesses it waited for), wall seconds, XLA compilations and their seconds, persistent
compilation-cache hits, and the load average when the test ended. CPU seconds hardly change with
the machine's load, wall seconds do: on a shared machine compare the CPU columns.

As a pytest plugin (one JSON line per test, one file per xdist worker):

  PYTHONPATH=benchmarks SUITE_PROFILE=/tmp/prof .venv/bin/python -m pytest -q -n 2 \\
      --dist loadfile tests -p suite_profile

and the summary, the costliest files first:

  .venv/bin/python benchmarks/suite_profile.py /tmp/prof.*.jsonl
"""
import collections
import json
import os
import sys
import time

import pytest

_compiles = {"n": 0, "s": 0.0, "hits": 0}


def _listen() -> None:
  import jax  # pylint: disable=import-outside-toplevel

  def on_duration(event, secs, **_):
    if event == "/jax/core/compile/backend_compile_duration":
      _compiles["n"] += 1
      _compiles["s"] += secs

  def on_event(event, **_):
    if event == "/jax/compilation_cache/cache_hits":
      _compiles["hits"] += 1

  jax.monitoring.register_event_duration_secs_listener(on_duration)
  jax.monitoring.register_event_listener(on_event)


def pytest_configure(config):
  del config
  _listen()


def _snapshot():
  t = os.times()
  return (t.user + t.system, t.children_user + t.children_system, time.monotonic(),
          _compiles["n"], _compiles["s"], _compiles["hits"])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  del nextitem
  a = _snapshot()
  yield
  b = _snapshot()
  row = dict(id=item.nodeid, cpu=b[0] - a[0], child=b[1] - a[1], wall=b[2] - a[2],
             compiles=b[3] - a[3], compile_s=b[4] - a[4], hits=b[5] - a[5],
             load=os.getloadavg()[0])
  out = os.environ.get("SUITE_PROFILE", "suite_profile")
  with open(f"{out}.{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.jsonl", "a",
            encoding="utf-8") as f:
    f.write(json.dumps(row) + "\n")


def summary(paths: list[str]) -> str:
  per = collections.defaultdict(collections.Counter)
  for path in paths:
    with open(path, encoding="utf-8") as f:
      for line in f:
        r = json.loads(line)
        c = per[r["id"].split("::")[0]]
        for k in ("cpu", "child", "wall", "compiles", "compile_s", "hits"):
          c[k] += r[k]
        c["tests"] += 1
  lines = ["| file | tests | CPU s | children's CPU s | wall s | compiles | compile s | cache hits |",
           "|---|---|---|---|---|---|---|---|"]
  total = collections.Counter()
  for name, c in sorted(per.items(), key=lambda kv: -(kv[1]["cpu"] + kv[1]["child"])):
    total.update(c)
    lines.append(f"| {name} | {c['tests']} | {c['cpu']:.1f} | {c['child']:.1f} | {c['wall']:.1f} | "
                 f"{c['compiles']} | {c['compile_s']:.1f} | {c['hits']} |")
  lines.append(f"| all | {total['tests']} | {total['cpu']:.1f} | {total['child']:.1f} | "
               f"{total['wall']:.1f} | {total['compiles']} | {total['compile_s']:.1f} | "
               f"{total['hits']} |")
  return "\n".join(lines)


if __name__ == "__main__":
  print(summary(sys.argv[1:]))
