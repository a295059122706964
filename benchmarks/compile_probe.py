"""Runs a Python module or script with jax's compile events written to a JSON-lines file: one line
per event (tracing, lowering to MLIR, XLA compilation or persistent-cache load) with its program's
name, its wall seconds and the process's CPU seconds when it ended (all threads: the CPU time
between the end of a program's lowering and the end of its compile is what XLA spent on it, which
other processes on a loaded machine barely change). The same probe for both trainers (benchmarks/compile_time.py), so their compile
times are measured by the same clock at the same points of jax.

    python benchmarks/compile_probe.py EVENTS.jsonl [--cache-dir DIR] -m package.module ARGS...
    python benchmarks/compile_probe.py EVENTS.jsonl [--cache-dir DIR] script.py ARGS...

--cache-dir turns jax's persistent compilation cache on in DIR for every program, however short
its compile (the trainers are told to leave the cache alone)."""
from __future__ import annotations

import json
import runpy
import sys
import time

EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
          "/jax/core/compile/backend_compile_duration": "compile",
          "/jax/compilation_cache/cache_retrieval_time_sec": "cache_load"}


def main() -> None:
  out, rest = sys.argv[1], sys.argv[2:]
  cache_dir = ""
  if rest[:1] == ["--cache-dir"]:
    cache_dir, rest = rest[1], rest[2:]
  import jax   # pylint: disable=import-outside-toplevel

  if cache_dir:
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  log = open(out, "a", encoding="utf-8")   # noqa: SIM115 (open for the whole run)

  def listen(event: str, secs: float, **kwargs) -> None:
    if event in EVENTS:
      log.write(json.dumps({"event": EVENTS[event], "name": str(kwargs.get("fun_name", "")),
                            "s": secs, "t": time.time(), "cpu": time.process_time()}) + "\n")
      log.flush()

  jax.monitoring.register_event_duration_secs_listener(listen)
  if rest[0] == "-m":
    sys.argv = [rest[1], *rest[2:]]
    runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
  else:
    sys.argv = rest
    runpy.run_path(rest[0], run_name="__main__")


if __name__ == "__main__":
  main()
