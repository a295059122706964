"""The run directory: a write check before anything compiles (exit 2 naming base_output_directory)
and the lock that keeps a second run with the same run_name out (exit 2 naming the holder), with a
stale lock of a dead process taken over and logged."""
import json
import os
import socket
import subprocess
import sys

import jax
import psutil

from conftest import MESH_1, train
from MaxText.runtime.run_dir import LOCK_NAME, RunLock, holder_alive

# the shapes of test_config's one-step run: the compiled step comes from the persistent cache
ONE_STEP = (*MESH_1, "steps=1", "enable_checkpointing=false", "per_device_batch_size=2",
            "learning_rate=1e-3", "seed=7")
ONE = dict(devices=jax.devices()[:1])


def _lock(path, **holder):
  os.makedirs(path, exist_ok=True)
  (path / LOCK_NAME).write_text(json.dumps(holder))


def _dead_pid() -> int:
  p = subprocess.Popen([sys.executable, "-c", "pass"])
  p.wait()
  return p.pid


def test_unwritable_base_output_directory_exits_2_naming_the_key(tmp_path, capsys):
  (tmp_path / "a_file").write_text("not a directory")
  code, rows, _ = train(tmp_path / "a_file" / "runs", "run", *ONE_STEP, **ONE)
  out, err = capsys.readouterr()
  assert code == 2 and rows == []
  assert f"base_output_directory='{tmp_path / 'a_file' / 'runs'}': cannot write the run " \
         f"directory" in err and "NotADirectoryError" in err
  assert "compiled" not in out and "Traceback" not in err


def test_second_live_run_exits_2_naming_the_holder(tmp_path, capsys):
  lock = RunLock(str(tmp_path / "run"), print)
  os.makedirs(tmp_path / "run")
  lock.acquire()                      # held by this (live) process, as by a run in progress
  try:
    code, rows, _ = train(tmp_path, "run", *ONE_STEP, **ONE)
  finally:
    lock.release()
  out, err = capsys.readouterr()
  assert code == 2 and rows == []
  assert f"is in use by pid {os.getpid()} on host {socket.gethostname()}" in err
  assert "choose another run_name" in err and "compiled" not in out
  assert not (tmp_path / "run" / "metrics.jsonl").exists()
  # the holder is gone: the same command runs, and leaves no lock behind
  code, rows, _ = train(tmp_path, "run", *ONE_STEP, **ONE)
  assert code == 0 and len(rows) == 1
  assert not (tmp_path / "run" / LOCK_NAME).exists()


def test_stale_lock_of_a_dead_process_is_taken_over_and_logged(tmp_path, capsys):
  """...and the rows the dead run wrote past its last checkpoint (none here) are said to be a dead
  run's, naming it (issue 38: an aborted run's rows were said to be an interrupted run's)."""
  pid = _dead_pid()
  _lock(tmp_path / "run", host=socket.gethostname(), pid=pid, process_start=1.0,
        since="2026-01-01T00:00:00", command="train.py (killed)")
  (tmp_path / "run" / "metrics.jsonl").write_text("".join(
      json.dumps({"step": s, "loss": 5.0}) + "\n" for s in (1, 2, 3)))
  code, rows, _ = train(tmp_path, "run", *ONE_STEP, **ONE)
  out = capsys.readouterr().out
  assert code == 0 and len(rows) == 1
  assert f"taking over the stale run lock {tmp_path / 'run' / LOCK_NAME} of pid {pid} on host " \
         f"{socket.gethostname()}" in out
  assert not (tmp_path / "run" / LOCK_NAME).exists()
  assert (f"metrics.jsonl: 3 rows (steps 1-3) written by a run that died without finishing (pid "
          f"{pid} on host {socket.gethostname()} (since 2026-01-01T00:00:00: train.py (killed)): "
          f"it left its run lock behind, so it crashed, aborted or was killed) before any "
          f"checkpoint; moved to metrics.superseded.jsonl, recomputed from step 1") in out
  assert "interrupted" not in out


def test_lock_of_another_host_is_refused_with_what_to_do(tmp_path, capsys):
  _lock(tmp_path / "run", host="other-host.example", pid=1234, process_start=1.0)
  code, _, _ = train(tmp_path, "run", *ONE_STEP, **ONE)
  err = capsys.readouterr().err
  assert code == 2
  assert "pid 1234 on host other-host.example" in err
  assert f"delete {tmp_path / 'run' / LOCK_NAME}" in err
  assert (tmp_path / "run" / LOCK_NAME).exists()   # never removed on a guess


def test_holder_liveness():
  me, start = socket.gethostname(), psutil.Process().create_time()
  assert holder_alive({"host": me, "pid": os.getpid(), "process_start": start}) is True
  # the same pid, but a process that started at another time: the pid was reused, the holder died
  assert holder_alive({"host": me, "pid": os.getpid(), "process_start": start - 100}) is False
  assert holder_alive({"host": me, "pid": _dead_pid()}) is False
  assert holder_alive({"host": "elsewhere", "pid": os.getpid()}) is None
  assert holder_alive({}) is None


def test_lock_is_released_when_the_run_fails(tmp_path, capsys):
  (tmp_path / "bad.jsonl").write_text("{not json\n")
  code, _, _ = train(tmp_path, "run", *ONE_STEP, "dataset_type=file",
                     f"dataset_path={tmp_path / 'bad.jsonl'}", **ONE)
  assert code == 3, capsys.readouterr()
  assert not (tmp_path / "run" / LOCK_NAME).exists()
