"""Local multi-process runs: N copies of a command on this machine, joined over loopback.

    python -m MaxText.launch.local processes=2 devices_per_process=4 [log_dir=DIR] \\
        [grace_s=30] [port=N] -- train.py configs/base.yml per_device_batch_size=1 ...

Each child gets `JAX_COORDINATOR_ADDRESS=127.0.0.1:<free port>`, `JAX_NUM_PROCESSES`,
`JAX_PROCESS_ID` (what `MaxText/runtime/distributed.py` reads), and with `devices_per_process` that
many fake CPU devices (`XLA_FLAGS=--xla_force_host_platform_device_count`, `JAX_PLATFORMS=cpu`;
collectives over gloo). A command starting with a `.py` file runs with this Python.

Supervision: when a child exits non-zero, the others get `grace_s` seconds to end by themselves
(all processes of a preempted run exit 42 at about the same time; a process whose peer died stops
at the heartbeat timeout), then the rest are killed (SIGKILL: a process blocked in a collective
does not answer SIGTERM, which the JAX preemption service takes as a preemption notice). The exit
status is the first non-zero child status (a child killed by signal n counts as 128 + n), else 0.
SIGTERM or SIGINT to the launcher is passed on to every child as SIGTERM: a preemption of the
whole run, which saves and exits 42.
"""
from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from typing import Sequence

import portpicker

from MaxText.config.cli import Arg, parse_own, split_command
from MaxText.config.load import ConfigError
from MaxText.runtime.exit_codes import reported


@dataclasses.dataclass
class ChildExit:
  process_id: int
  returncode: int        # as Popen reports it: -n for a signal
  seconds: float         # after the launch started

  @property
  def status(self) -> int:
    """Shell-style status: 128 + n for signal n."""
    return 128 - self.returncode if self.returncode < 0 else self.returncode


@dataclasses.dataclass
class Result:
  status: int                    # the first non-zero child status, else 0
  exits: list[ChildExit]         # in the order the children ended
  killed: list[int]              # process ids the launcher killed after the grace period


def child_env(process_id: int, num_processes: int, address: str, devices_per_process: int | None,
              base: dict[str, str] | None = None) -> dict[str, str]:
  env = dict(os.environ if base is None else base)
  env.update(JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES=str(num_processes),
             JAX_PROCESS_ID=str(process_id))
  if devices_per_process:
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = (flags + f" --xla_force_host_platform_device_count={devices_per_process}"
                        ).strip()
    env["JAX_PLATFORMS"] = "cpu"
  return env


def _command(cmd: Sequence[str]) -> list[str]:
  cmd = list(cmd)
  if not cmd:
    raise ValueError("no command to launch")
  return [sys.executable, *cmd] if cmd[0].endswith(".py") else cmd


def _log(msg: str) -> None:
  print(f"[launch] {msg}", file=sys.stderr, flush=True)


def launch(cmd: Sequence[str], num_processes: int, *, devices_per_process: int | None = None,
           log_dir: str | None = None, grace_s: float = 30.0, port: int | None = None,
           cwd: str | None = None, env: dict[str, str] | None = None,
           extra_env: Sequence[dict[str, str]] | None = None, timeout_s: float | None = None
           ) -> Result:
  """Runs `num_processes` copies of `cmd` and supervises them (see the module docstring).
  `log_dir`: each child's stdout and stderr go to `process_<i>.out` / `.err` there (else they
  are inherited). `extra_env[i]`: variables for child i only. `timeout_s`: kill all after this."""
  if num_processes < 1:
    raise ValueError(f"num_processes={num_processes} must be >= 1")
  address = f"127.0.0.1:{port or portpicker.pick_unused_port()}"
  argv = _command(cmd)
  start = time.monotonic()
  procs: list[subprocess.Popen] = []
  files = []
  try:
    for i in range(num_processes):
      child = child_env(i, num_processes, address, devices_per_process, env)
      if extra_env:
        child.update(extra_env[i])
      out = err = None
      if log_dir:
        os.makedirs(log_dir, exist_ok=True)
        out = open(os.path.join(log_dir, f"process_{i}.out"), "w", encoding="utf-8")
        err = open(os.path.join(log_dir, f"process_{i}.err"), "w", encoding="utf-8")
        files += [out, err]
      procs.append(subprocess.Popen(argv, env=child, cwd=cwd, stdout=out, stderr=err,
                                    start_new_session=True))
    return _supervise(procs, start, grace_s, timeout_s)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
    for f in files:
      f.close()


def _supervise(procs: list[subprocess.Popen], start: float, grace_s: float,
               timeout_s: float | None) -> Result:
  exits: list[ChildExit] = []
  killed: list[int] = []
  deadline = start + timeout_s if timeout_s else None

  def forward(signum, frame):
    del frame
    _log(f"{signal.Signals(signum).name}: passing SIGTERM to every process (preemption)")
    for p in procs:
      if p.poll() is None:
        p.send_signal(signal.SIGTERM)

  previous = {}
  try:
    for signum in (signal.SIGTERM, signal.SIGINT):
      previous[signum] = signal.signal(signum, forward)
  except ValueError:  # not the main thread: no forwarding
    pass
  try:
    done: set[int] = set()
    while len(done) < len(procs):
      for i, p in enumerate(procs):
        if i not in done and p.poll() is not None:
          done.add(i)
          exits.append(ChildExit(i, p.returncode, time.monotonic() - start))
          if p.returncode != 0:
            first_failure = next(e for e in exits if e.returncode != 0)
            if first_failure.process_id == i:
              _log(f"process {i} exited with status {exits[-1].status}; the others get "
                   f"{grace_s:g} s to end")
              grace_end = time.monotonic() + grace_s
              deadline = grace_end if deadline is None else min(deadline, grace_end)
      if deadline is not None and time.monotonic() >= deadline and len(done) < len(procs):
        for i, p in enumerate(procs):
          if i not in done and p.poll() is None:
            p.kill()
            killed.append(i)
        _log(f"killed process(es) {killed}")
        for i, p in enumerate(procs):
          if i not in done:
            p.wait()
            done.add(i)
            exits.append(ChildExit(i, p.returncode, time.monotonic() - start))
      time.sleep(0.05)
  finally:
    for signum, handler in previous.items():
      signal.signal(signum, handler)
  status = next((e.status for e in exits if e.returncode != 0), 0)
  return Result(status, exits, killed)


ARGS = {
    "processes": Arg(int, 2, "processes of the run (each gets JAX_NUM_PROCESSES and its id)"),
    "devices_per_process": Arg(int, 0, "fake CPU devices per process (sets XLA_FLAGS and "
                               "JAX_PLATFORMS=cpu); 0 = the platform's own"),
    "log_dir": Arg(str, "", "write each process's stdout/stderr to process_<i>.out/.err here"),
    "grace_s": Arg(float, 30.0, "after a process fails, seconds the others get before being "
                   "killed"),
    "port": Arg(int, 0, "coordinator port; 0 = a free one"),
}


def main(argv: Sequence[str] | None = None) -> int:
  own, cmd = split_command(sys.argv[1:] if argv is None else argv)

  def run() -> int:
    args = parse_own(own, ARGS, __doc__, program="launch_local")
    if args is None:
      return 0
    if not cmd:
      raise ConfigError("no command given (e.g. -- train.py configs/base.yml)")
    result = launch(cmd, args["processes"], devices_per_process=args["devices_per_process"] or None,
                    log_dir=args["log_dir"] or None, grace_s=args["grace_s"],
                    port=args["port"] or None)
    _log("exit statuses: " + ", ".join(f"process {e.process_id}: {e.status}"
                                       for e in sorted(result.exits, key=lambda e: e.process_id)))
    return result.status
  return reported(run, (ConfigError,))


if __name__ == "__main__":
  sys.exit(main())
