"""Multi-host training proven with several processes on one machine: `MaxText.launch.local` runs
`train.py` as 2 processes x 4 fake CPU devices joined over loopback (gloo collectives), against the
same model on 1 process x 8 devices in this process.

One 2-process run (10 steps, checkpoints at 5 and 10) serves several tests; each further
2-process launch (preemption, kill -9) costs a start-up and a compile on process 1 (JAX's
persistent cache is written and hit by process 0 only)."""
import json
import os
import re
import shutil

import numpy as np
import pytest

from conftest import MESH_222, ROOT, argv, read_metrics, train
from MaxText.launch import local

# one layer: process 1 compiles the step in a third of the time of two
COMMON = (*MESH_222, "num_decoder_layers=1", "steps=10", "checkpoint_period=5",
          "max_checkpoints_to_keep=5")
FSDP8 = ("ici_data_parallelism=1", "ici_fsdp_parallelism=8", "ici_tensor_parallelism=1")
TOL = 1e-5
SAMPLE = ("sample_at_end=true", "max_new_tokens=8")   # the decoding engine across 2 processes


def _launch(out, name, *overrides, fault="", grace_s=60.0):
  """train.py on 2 processes x 4 devices; returns (launch result, {process: stdout + stderr})."""
  logs = out / f"{name}-logs"
  env = dict(os.environ, MAXTEXT_FAULT=fault)
  result = local.launch([os.path.join(ROOT, "train.py"), *argv(out, name, *COMMON, *overrides)],
                        2, devices_per_process=4, log_dir=str(logs), grace_s=grace_s, cwd=ROOT,
                        env=env, timeout_s=400)
  text = {i: (logs / f"process_{i}.out").read_text() + (logs / f"process_{i}.err").read_text()
          for i in (0, 1)}
  return result, text


def _statuses(result):
  return {e.process_id: e.status for e in result.exits}


def _same(rows, ref_rows, steps):
  """Losses within TOL and identical batch checksums (the same global batches) at `steps`."""
  by_step = {r["step"]: r for r in rows}
  ref = {r["step"]: r for r in ref_rows}
  assert sorted(by_step) == sorted(steps), sorted(by_step)
  np.testing.assert_allclose([by_step[s]["loss"] for s in steps], [ref[s]["loss"] for s in steps],
                             rtol=0, atol=TOL)
  assert [by_step[s]["batch_checksum"] for s in steps] == [ref[s]["batch_checksum"] for s in steps]


def _copy_until(src, dst, step):
  """A copy of run directory `src` whose checkpoints stop at `step` (the later ones removed)."""
  shutil.copytree(src, dst)
  for name in os.listdir(dst / "checkpoints"):
    if name.isdigit() and int(name) > step:
      shutil.rmtree(dst / "checkpoints" / name)


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("mp")
  result, text = _launch(out, "run", "enable_tensorboard=true", *SAMPLE)
  assert _statuses(result) == {0: 0, 1: 0}, text[0][-3000:] + text[1][-3000:]
  return out, text, read_metrics(out / "run")


def _sample(log: str) -> str:
  m = re.search(r"^sample after step 10 [^\n]*\n(?:  [^\n]*\n?)*", log, re.M)
  assert m, log[-2000:]
  return m.group(0)


def test_two_processes_train_like_one_and_split_the_batch(two_process_run, tmp_path, capsys):
  out, text, rows = two_process_run
  # metrics and TensorBoard: process 0 only (one row per step, one event file)
  assert [r["step"] for r in rows] == list(range(1, 11))
  events = [f for _, _, fs in os.walk(out / "run" / "tensorboard") for f in fs]
  assert len(events) == 1, events
  # each process logs its own lines; the run's lines (summary, steps) come from process 0 only
  assert "distributed: 2 processes, 8 devices" in text[0]
  assert re.search(r"^step +10/10 \| loss", text[0], re.M)
  assert "distributed:" not in text[1] and not re.search(r"^step ", text[1], re.M)
  rows_of = {}
  for i in (0, 1):
    assert f"[process {i}/2] host " in text[i] and f"[process {1 - i}/2]" not in text[i]
    m = re.search(rf"\[process {i}/2\] feeds rows (\d+)-(\d+) of the global batch of 8: "
                  rf"data shard {i} of 2", text[i])
    assert m, text[i][-2000:]
    rows_of[i] = set(range(int(m.group(1)), int(m.group(2)) + 1))
  assert not rows_of[0] & rows_of[1] and rows_of[0] | rows_of[1] == set(range(8))
  # each process digested the array files it wrote; process 0's commit-time list has none of
  # process 1's (it never reads them)
  from MaxText.checkpoint import manifest
  step = out / "run" / "checkpoints" / "5"
  for i in (0, 1):
    own = json.loads((step / "params" / f"files.process_{i}.json").read_text())
    assert own and {manifest.writer_of(r) for r in own} == {i}
  assert all(manifest.writer_of(r) is None
             for r in json.loads((step / "manifest" / "files.json").read_text()))
  # each process saved its own shard's iterator position
  assert sorted(f for f in os.listdir(out / "run" / "checkpoints" / "5" / "data")
                if f.endswith(".json")) == ["shard_0-of-2.json", "shard_1-of-2.json"]
  # 1 process x 8 devices reading the same 2 shards: the same global batches, the same losses;
  # on another mesh (all fsdp), the one the SIGTERM test's 1-process resume compiles its step for
  # (that compile is then a cache hit)
  code, ref, _ = train(tmp_path, "one", *COMMON, *FSDP8, "data_shards=2",
                       "enable_checkpointing=false", *SAMPLE)
  assert code == 0
  _same(rows, ref, range(1, 11))
  # the end-of-run sample: decoded by both processes, printed by process 0, as by one process
  assert _sample(text[0]) == _sample(capsys.readouterr().out)
  assert "sample after step" not in text[1]


def test_sigterm_to_one_process_saves_the_same_step_on_both_and_resumes(two_process_run,
                                                                         tmp_path, capsys):
  """A 2-process run resumed from step 5 (a multi-process restore); process 1 alone gets SIGTERM
  after step 6: both stop after the same step, save it, exit 42; 1 process with 8 devices
  restores that step saved by 2 processes, on another mesh (all fsdp), taking data_shards=2 from
  the checkpoint: the later steps see the same batches and give the same losses. (One restore by
  1 process serves both claims: a same-mesh restore of the fixture's step 5 was a second
  in-process trainer on the same restore path.)"""
  out, _, rows = two_process_run
  _copy_until(out / "run", tmp_path / "run", 5)
  result, text = _launch(tmp_path, "run", fault="sigterm_at_step:6@1")
  assert _statuses(result) == {0: 42, 1: 42}, text[0][-3000:] + text[1][-3000:]
  assert "[fault] SIGTERM at step 6" in text[1] and "[fault]" not in text[0]
  assert "[fault] every process has told the preemption service its step" in text[1], text[1][-2000:]
  stopped = set()
  for i in (0, 1):
    m = re.search(rf"\[process {i}/2\] preempted \(.*\): step (\d+) saved and committed", text[i])
    assert m, text[i][-2000:]
    stopped.add(int(m.group(1)))
  (step,) = stopped
  assert 6 <= step < 10
  assert sorted(map(int, filter(str.isdigit, os.listdir(tmp_path / "run" / "checkpoints")))) == \
      [5, step]
  after = read_metrics(tmp_path / "run")[5:]   # the copy's rows 6-10 were superseded on resume
  _same(after, rows, range(6, step + 1))
  code, resumed, _ = train(tmp_path, "run", *COMMON, *FSDP8)
  log = capsys.readouterr().out
  assert code == 0
  assert f"resumed from {tmp_path / 'run' / 'checkpoints'}/{step}" in log
  assert "data shards 0-1 of 2 (4 rows each; data_shards from the checkpoint)" in log
  assert [r["step"] for r in resumed] == list(range(1, 11))
  _same(resumed[step:], rows, range(step + 1, 11))


def test_kill_9_of_one_process_stops_the_other_within_the_heartbeat_timeout(two_process_run,
                                                                            tmp_path):
  """Resumed from step 5 by 2 processes, process 1 is killed (-9) mid-step 6: process 0, blocked
  in a collective, is stopped by the JAX runtime once the heartbeat timeout has passed."""
  heartbeat = 6
  _copy_until(two_process_run[0] / "run", tmp_path / "run", 5)
  result, text = _launch(tmp_path, "run", f"distributed_heartbeat_timeout_s={heartbeat}",
                         fault="kill_at_step:6@1", grace_s=300)
  exits = {e.process_id: e for e in result.exits}
  assert exits[1].status == 128 + 9 and "[fault] SIGKILL at step 6" in text[1]
  # it stopped by itself, not by the launcher (whose grace of 300 s it did not need)
  assert exits[0].status != 0 and not result.killed, (exits, text[0][-2000:])
  assert result.status == 128 + 9  # the first failure
