"""Crash safety, preemption and failing saves, with the fault hooks of MaxText/runtime/faults.py.

kill -9 runs are subprocesses (`train.py`, same 8 fake CPU devices as this process, so the compiled
steps and the numbers are identical); everything else runs in this process. Every run is the one
configuration (COMMON: 10 steps, a checkpoint every 3 and at the last step): `steps` is in the
learning-rate schedule, so each other value would be another train-step program to compile (10 on
data 2 x fsdp 2 x tensor 2 is test_train.py's resume run: the same program, which the persistent
cache holds once for both files), and a run of 10 steps has saves before and after each fault's
step, and a step or more after every resume point."""
import json
import os
import re
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import MESH_222, ROOT, argv, read_metrics, train
from MaxText.checkpoint.manager import RunCheckpoints, load_params
from MaxText.runtime import faults

STEPS = 10
COMMON = (f"steps={STEPS}", "checkpoint_period=3", "max_checkpoints_to_keep=5",
          "dataset_type=synthetic", *MESH_222)


def _subprocess(out, name, fault, *overrides):
  env = dict(os.environ, MAXTEXT_FAULT=fault)
  return subprocess.run([sys.executable, os.path.join(ROOT, "train.py"),
                         *argv(out, name, *COMMON, *overrides)],
                        cwd=ROOT, env=env, capture_output=True, text=True, check=False)


def read_metrics_file(path):
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f]


def _final_params(run_dir, step):
  return jax.tree.leaves(load_params(str(run_dir / "checkpoints" / str(step)), None))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """The uninterrupted run: metrics rows and final parameters."""
  out = tmp_path_factory.mktemp("reference")
  code, rows, _ = train(out, "ref", *COMMON)
  assert code == 0 and [r["step"] for r in rows] == list(range(1, STEPS + 1))
  return rows, _final_params(out / "ref", STEPS)


def _assert_same_as_reference(rows, params, reference, first_step):
  ref_rows, ref_params = reference
  assert [r["step"] for r in rows] == list(range(first_step, STEPS + 1))
  for key in ("loss", "grad_norm", "batch_checksum"):
    assert [r[key] for r in rows] == [r[key] for r in ref_rows[first_step - 1:]], key
  assert len(params) == len(ref_params)
  for a, b in zip(params, ref_params):
    assert np.array_equal(a, b)


def test_kill_9_mid_step_resumes_bitwise(tmp_path, reference, capsys):
  """kill -9 while step 9 of 10 runs (checkpoint period 3) → rerun resumes at 6; steps 7-10
  (losses, gradient norms, batch checksums) and the final parameters equal the uninterrupted run."""
  p = _subprocess(tmp_path, "run", "kill_at_step:9")
  assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
  assert "[fault] SIGKILL at step 9" in p.stderr
  killed_rows = read_metrics(tmp_path / "run")
  assert [r["step"] for r in killed_rows] == list(range(1, 9))
  assert sorted(os.listdir(tmp_path / "run" / "checkpoints"), key=int) == ["3", "6"]
  with open(tmp_path / "run" / "run.lock", encoding="utf-8") as f:
    killed_pid = json.load(f)["pid"]                    # the killed run could not remove it
  code, rows, _ = train(tmp_path, "run", *COMMON)
  assert code == 0
  assert f"stale run lock {tmp_path / 'run' / 'run.lock'} of pid {killed_pid} on host" in \
      capsys.readouterr().out
  # metrics.jsonl: one row per step; rows 7-8 of the killed run were moved aside
  assert [r["step"] for r in rows] == list(range(1, STEPS + 1)) and rows[:6] == killed_rows[:6]
  assert read_metrics_file(tmp_path / "run" / "metrics.superseded.jsonl") == killed_rows[6:]
  _assert_same_as_reference(rows[6:], _final_params(tmp_path / "run", STEPS), reference, 7)


@pytest.mark.parametrize("fault", ["before_commit:6", "kill_in_save:6"])
def test_kill_9_during_async_save_keeps_previous_step(tmp_path, capsys, fault):
  """kill -9 just before step 6's commit (all files written) or while its files are written →
  the rerun restores 3, never a partial 6, and no temporary directory survives its next save."""
  p = _subprocess(tmp_path, "run", fault)
  assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
  ckpt = tmp_path / "run" / "checkpoints"
  names = os.listdir(ckpt)
  assert "3" in names and "6" not in names
  assert any(n.startswith("6.orbax-checkpoint-tmp") for n in names), names  # the partial save
  code, rows, _ = train(tmp_path, "run", *COMMON)
  assert code == 0
  assert f"resumed from {ckpt}/3" in capsys.readouterr().out
  assert [r["step"] for r in rows][-7:] == list(range(4, STEPS + 1))
  assert sorted(os.listdir(ckpt), key=int) == ["3", "6", "9", "10"]


def test_sigterm_saves_the_step_and_exits_42_then_resumes_exactly(tmp_path, monkeypatch, capsys,
                                                                    reference):
  monkeypatch.setenv(faults.ENV, "sigterm_at_step:5")
  code, rows, _ = train(tmp_path, "run", *COMMON)
  out, err = capsys.readouterr()
  assert code == 42
  assert re.search(r"\[fault\] SIGTERM at step 5 \(t=[0-9.]+\)", err), err[-2000:]
  assert "preempted (SIGTERM): step 5 saved and committed" in out
  assert rows[-1]["step"] == 5  # the step in flight was finished, nothing after it
  assert sorted(os.listdir(tmp_path / "run" / "checkpoints"), key=int) == ["3", "5"]
  monkeypatch.delenv(faults.ENV)
  code, resumed, _ = train(tmp_path, "run", *COMMON)
  assert code == 0
  _assert_same_as_reference(resumed[5:], _final_params(tmp_path / "run", STEPS), reference, 6)


def _custom_sigint_handler(signum, frame):
  del signum, frame


def test_a_notice_before_a_resumed_runs_first_step_is_met_by_every_process(monkeypatch):
  """Several processes: JAX's sync point is 1 + the largest call counter reported when the notice
  came (0 before any call) and is met by that counter exactly. A run resumed from step 5 whose
  notice came before its first `should_stop` gets sync point 1: the counter passed is the count of
  calls, so the first step meets it (passing the step, 6, never did: the 2-process SIGTERM test's
  runs went on to the last step when the SIGTERM beat both processes' first step)."""
  from MaxText.runtime import preemption
  passed, point = [], {"at": None}
  monkeypatch.setattr(preemption.multihost_utils, "reached_preemption_sync_point",
                      lambda counter: passed.append(counter) or counter == point["at"])
  monkeypatch.setattr(preemption.jax, "process_count", lambda: 2)
  monkeypatch.setattr(preemption, "_SYNC_CALLS", 0)   # a fresh process: no call yet
  watch = preemption.PreemptionWatch()
  point["at"] = max([0]) + 1   # both processes reported 0 (no call yet)
  assert [watch.should_stop(s) for s in (6, 7, 8)] == [True, False, False]
  assert passed == [1, 2, 3]


@pytest.mark.parametrize("before", [signal.default_int_handler, signal.SIG_IGN,
                                    _custom_sigint_handler],
                         ids=["python_default", "ignored_as_in_a_background_job", "custom"])
def test_second_sigint_interrupts_at_once(before):
  """First SIGINT: a stop request; second: KeyboardInterrupt; afterwards the handler found before
  is back — whatever it was (a shell starting a background job sets SIGINT to SIG_IGN)."""
  from MaxText.runtime.preemption import PreemptionWatch
  found = signal.signal(signal.SIGINT, before)
  try:
    with PreemptionWatch() as watch:
      os.kill(os.getpid(), signal.SIGINT)
      assert watch.signal_name == "SIGINT" and watch.should_stop(1)
      with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before
  finally:
    signal.signal(signal.SIGINT, found)


def test_a_stop_signal_is_announced_though_the_run_is_left_before_the_watcher_runs(capsys):
  """Two quick Ctrl-Cs: the main thread leaves the run (KeyboardInterrupt) while the watcher thread
  has not run yet (a long thread switch interval keeps it waiting); it still announces the first."""
  from MaxText.runtime.preemption import PreemptionWatch
  interval = sys.getswitchinterval()
  sys.setswitchinterval(1.0)
  try:
    with pytest.raises(KeyboardInterrupt), PreemptionWatch():
      os.kill(os.getpid(), signal.SIGINT)
      os.kill(os.getpid(), signal.SIGINT)
  finally:
    sys.setswitchinterval(interval)
  err = capsys.readouterr().err
  assert err.count("SIGINT received: the run stops after the step in flight") == 1, err
  assert "exiting now" not in err


_STUCK_RUN = """
import signal, sys, time
from MaxText.runtime.preemption import PreemptionWatch
with PreemptionWatch() as watch:
  print("ready", flush=True)
  while watch.signal_name is None:  # the first signal's handler has run in this (main) thread
    time.sleep(0.01)
  print("stop requested", flush=True)
  time.sleep(120)  # a step that never finishes: the loop never asks should_stop
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_second_signal_ends_a_run_whose_step_never_finishes(signum):
  """A stop request the loop never gets to answer (a hung step or save): the first signal is
  announced, the second ends the process within the grace period with 128 + the signal."""
  proc = subprocess.Popen([sys.executable, "-c", _STUCK_RUN], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True)
  try:
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signum)
    assert proc.stdout.readline().strip() == "stop requested"
    assert proc.poll() is None  # the first signal only asks for a stop
    proc.send_signal(signum)
    code = proc.wait()  # the step sleeps for 2 minutes: an exit now is the second signal's
  finally:
    proc.kill()
  err = proc.stderr.read()
  name = signal.Signals(signum).name
  assert f"{name} received: the run stops after the step in flight" in err
  if signum == signal.SIGINT:  # the main thread was in the interpreter: StopNow (KeyboardInterrupt)
    assert code != 0 and "StopNow: second stop signal (SIGINT): exiting now" in err
  else:
    assert code == 128 + signum, err
    assert f"second stop signal ({name}): exiting now" in err


def test_ctrl_c_twice_ends_a_train_py_run_with_one_line_and_exit_130(tmp_path):
  """issue 58: Ctrl-C twice ended `train.py` with a 55-line KeyboardInterrupt traceback. A real run
  (the same program as the runs above) whose step-3 checkpoint write hangs: the first SIGINT asks
  for a stop (announced), which waits on that save; the second ends the run at once with the one
  line a second SIGTERM prints and 128 + SIGINT, nothing saved. Each signal is sent once the line
  before it is printed (the hang, then the announcement); the hang lasts 120 s."""
  env = dict(os.environ, MAXTEXT_FAULT="save_hang:3")
  proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"),
                           *argv(tmp_path, "run", *COMMON)], cwd=ROOT, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          start_new_session=True)
  err = []
  try:
    for wait_for in ("[fault] checkpoint 3 write hangs", "SIGINT received: the run stops"):
      while not err or wait_for not in err[-1]:
        line = proc.stderr.readline()
        assert line, "".join(err)[-3000:]   # the run ended before printing it
        err.append(line)
      proc.send_signal(signal.SIGINT)
    err += proc.stderr.readlines()
    code = proc.wait()
  finally:
    proc.kill()
  text = "".join(err)
  assert code == 130, text[-3000:]
  assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
  assert text.rstrip().splitlines()[-1] == ("second stop signal (SIGINT): exiting now, without "
                                            "saving the step in flight (exit 130)"), text[-3000:]


def test_async_save_write_error_exits_4_and_that_step_never_restores(tmp_path, monkeypatch,
                                                                      capsys):
  monkeypatch.setenv(faults.ENV, "save_error:6")
  code, rows, _ = train(tmp_path, "run", *COMMON)
  err = capsys.readouterr().err
  assert code == 4
  assert "saving checkpoint step 6 failed" in err and "No space left on device" in err
  assert "step 6 was not committed (latest committed step: 3)" in err
  assert rows[-1]["step"] <= 9  # stopped at the next step, at the latest at the next save
  ckpt = tmp_path / "run" / "checkpoints"
  assert "6" not in os.listdir(ckpt) and "3" in os.listdir(ckpt)
  monkeypatch.delenv(faults.ENV)
  code, rows, _ = train(tmp_path, "run", *COMMON)
  assert code == 0 and f"resumed from {ckpt}/3" in capsys.readouterr().out
  assert sorted(os.listdir(ckpt), key=int) == ["3", "6", "9", "10"]


def test_hung_save_times_out_with_exit_4(tmp_path, monkeypatch, capsys):
  faults.RELEASE.clear()
  monkeypatch.setenv(faults.ENV, "save_hang:3")
  try:
    code, _, _ = train(tmp_path, "run", *COMMON, "checkpoint_save_timeout_s=2")
  finally:
    faults.RELEASE.set()  # lets the stuck background write end
  assert code == 4
  err = capsys.readouterr().err
  assert "checkpoint step 3" in err and "step 3 was not committed (latest committed step: none)" in err
  # the timeout's message, not the injected hang's own end (it waits for RELEASE, set only above)
  assert "(checkpoint_save_timeout_s=2): storage hung or too slow" in err, err[-2000:]
  ckpt = RunCheckpoints(str(tmp_path / "run" / "checkpoints"), max_to_keep=3, async_save=False)
  assert ckpt.all_steps() == []
  ckpt.close()
