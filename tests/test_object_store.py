"""A run, its data and its exports on an object store: `base_output_directory=gs://…`,
`dataset_path=gs://…/*.parquet`, `load_parameters_path=gs://…`, `to_huggingface output_path=gs://…`,
against a GCS emulator these tests start on 127.0.0.1 (tests/gcs_emulator.py; every client pointed
at it by its own documented setting).

The oracle is the same run on local paths: the run on the store (killed with -9 in the middle of
an async save, then resumed) has the local run's losses and final parameters bit for bit, and its
Hugging Face export has the local export's bytes. The run lock is an object created only if absent
(a second run on the same run_name exits 2), a damaged or missing object exits 4 naming it, and a
bucket that does not exist exits 2 before anything compiles."""
import io
import json
import os
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import MESH_222, ROOT, argv, train
from gcs_emulator import GcsEmulator

BUCKET = "runs"
OUT = f"gs://{BUCKET}/out"
RUN = ("steps=4", "checkpoint_period=2", "max_checkpoints_to_keep=5", "dataset_type=file",
       "enable_tensorboard=true", *MESH_222)


def _docs(n: int, seed: int) -> list[str]:
  rng = np.random.default_rng(seed)
  words = ["alpha", "beta", "gamma", "delta", "object", "store", "bucket", "step", "run", "shard"]
  return [" ".join(rng.choice(words, size=int(rng.integers(20, 60)))) for _ in range(n)]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
  """The emulator with the bucket `runs`, holding gs://runs/data/{a,b}.parquet (and the same two
  files in a local folder)."""
  import pyarrow as pa
  import pyarrow.parquet as pq
  local = tmp_path_factory.mktemp("data")
  with GcsEmulator(tmp_path_factory.mktemp("gcs")) as emulator:
    emulator.create_bucket(BUCKET)
    from MaxText.storage import paths
    for name, seed in (("a", 0), ("b", 1)):
      buf = io.BytesIO()
      pq.write_table(pa.table({"text": _docs(40, seed)}), buf, row_group_size=16)
      (local / f"{name}.parquet").write_bytes(buf.getvalue())
      paths.write_bytes(f"gs://{BUCKET}/data/{name}.parquet", buf.getvalue())
    yield emulator, local


def _params(ckpt_step_dir: str) -> list[np.ndarray]:
  from MaxText.checkpoint.manager import load_params
  return jax.tree.leaves(load_params(ckpt_step_dir, None))


def _gs_rows(run_dir: str) -> list[dict]:
  from MaxText.storage import paths
  return [json.loads(line) for line in paths.read_text(f"{run_dir}/metrics.jsonl").splitlines()
          if line.strip()]


@pytest.fixture(scope="module")
def local_run(store, tmp_path_factory):
  """The oracle: the same run on local paths, local data."""
  _, data = store
  out = tmp_path_factory.mktemp("local")
  code, rows, _ = train(out, "run", *RUN, f"dataset_path={data}/*.parquet")
  assert code == 0 and [r["step"] for r in rows] == list(range(1, 5))
  return out / "run", rows, _params(str(out / "run" / "checkpoints" / "4"))


GS_DATA = f"dataset_path=gs://{BUCKET}/data/*.parquet"


@pytest.fixture(scope="module")
def killed_and_resumed(store, local_run):
  """`train.py` on the store, killed with -9 while step 4's checkpoint (its last) is written, then
  the same command again: it resumes at 2 and trains steps 3 and 4 anew."""
  del local_run  # compiled first (the cache), so the subprocess's step is the same program
  env = dict(os.environ, MAXTEXT_FAULT="kill_in_save:4")
  killed = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"),
                           *argv(OUT, "run", *RUN, GS_DATA)],
                          cwd=ROOT, env=env, capture_output=True, text=True, check=False)
  from MaxText.storage import paths
  import orbax.checkpoint as ocp
  ckpts = f"{OUT}/run/checkpoints"
  after_kill = {"code": killed.returncode, "stderr": killed.stderr,
                "committed": sorted(ocp.utils.checkpoint_steps(ckpts)),
                "step4": sorted(paths.files_under(f"{ckpts}/4")),
                "lock": json.loads(paths.read_text(f"{OUT}/run/run.lock"))}
  code, _, _ = train(OUT, "run", *RUN, GS_DATA)
  return after_kill, code


def test_killed_mid_save_on_the_store_resumes_bitwise(killed_and_resumed, local_run, capfd):
  after_kill, code = killed_and_resumed
  assert after_kill["code"] == -signal.SIGKILL, after_kill["stderr"][-3000:]
  assert "[fault] SIGKILL" in after_kill["stderr"]
  # no rename on the store: step 4's objects are there, but without Orbax's commit marker it
  # does not count; step 2 does
  assert after_kill["committed"] == [2]
  assert after_kill["step4"] and "commit_success.txt" not in after_kill["step4"]
  assert code == 0
  from MaxText.storage import paths
  import orbax.checkpoint as ocp
  assert sorted(ocp.utils.checkpoint_steps(f"{OUT}/run/checkpoints")) == [2, 4]
  _, local_rows, local_params = local_run
  rows = _gs_rows(f"{OUT}/run")
  assert [r["step"] for r in rows] == list(range(1, 5))
  for key in ("loss", "grad_norm", "batch_checksum"):
    assert [r[key] for r in rows] == [r[key] for r in local_rows], key
  params = _params(f"{OUT}/run/checkpoints/4")
  assert len(params) == len(local_params)
  assert all(np.array_equal(a, b) for a, b in zip(params, local_params))
  # what else the run writes is there too, and the lock is gone
  names = paths.listdir(f"{OUT}/run")
  assert {"config.yml", "metrics.jsonl", "tensorboard", "checkpoints"} <= set(names)
  assert "run.lock" not in names
  assert any(n.startswith("events.out.tfevents") for n in paths.listdir(f"{OUT}/run/tensorboard"))
  assert paths.isfile(f"{OUT}/run/checkpoints/4/manifest/files.json")


def test_a_second_run_on_the_same_run_name_is_refused_by_the_lock(store, capsys):
  import socket
  from MaxText.runtime.run_dir import RunLock
  from MaxText.storage import paths
  run_dir = f"{OUT}/locked"
  lock = RunLock(run_dir, print).acquire()   # held by this live process, as by a run in progress
  try:
    assert not paths.create_new(f"{run_dir}/run.lock", b"{}")   # the precondition holds
    with pytest.raises(Exception, match="is in use by"):
      RunLock(run_dir, print).acquire()
    code, _, _ = train(OUT, "locked", *RUN, GS_DATA)
  finally:
    lock.release()
  out, err = capsys.readouterr()
  assert code == 2
  assert f"is in use by pid {os.getpid()} on host {socket.gethostname()}" in err
  assert f"(lock {run_dir}/run.lock)" in err and "compiled" not in out
  assert not paths.exists(f"{run_dir}/run.lock") and not paths.exists(f"{run_dir}/metrics.jsonl")


def _copy_run(src: str, dst: str) -> None:
  from MaxText.storage import paths
  fs, _ = paths.filesystem(src)
  for rel in paths.files_under(src):
    fs.copy(f"{src}/{rel}".split("://", 1)[1], f"{dst}/{rel}".split("://", 1)[1])


def test_damaged_or_missing_objects_exit_4_naming_them(killed_and_resumed, capsys):
  del killed_and_resumed
  from MaxText.storage import paths
  src = f"{OUT}/run/checkpoints"
  dst = f"{OUT}/damaged/checkpoints"
  _copy_run(f"{src}/4", f"{dst}/4")
  files = paths.files_under(f"{dst}/4/params")
  rel, size = max(((r, n) for r, n in files.items() if "ocdbt.process_0/d/" in r),
                  key=lambda item: item[1])
  whole = paths.read_bytes(f"{dst}/4/params/{rel}")
  paths.write_bytes(f"{dst}/4/params/{rel}", whole[:size // 2])
  code, _, _ = train(OUT, "damaged", *RUN, GS_DATA, "steps=6")
  err = capsys.readouterr().err
  assert code == 4
  assert f"params/{rel}: {size // 2} bytes, {size} when saved (truncated" in err
  paths.write_bytes(f"{dst}/4/params/{rel}", whole)
  paths.remove(f"{dst}/4/opt_state/_METADATA")
  code, _, _ = train(OUT, "damaged", *RUN, GS_DATA, "steps=6")
  err = capsys.readouterr().err
  assert code == 4 and "opt_state/_METADATA: missing" in err


def test_a_bucket_that_does_not_exist_is_refused_before_compiling(store, capsys):
  code, _, _ = train("gs://no-such-bucket/runs", "run", *RUN, GS_DATA)
  out, err = capsys.readouterr()
  assert code == 2
  assert "base_output_directory='gs://no-such-bucket/runs': cannot write the run directory " \
         "gs://no-such-bucket/runs/run" in err
  assert "compiled" not in out and "Traceback" not in err


def test_to_huggingface_reads_and_writes_the_store(killed_and_resumed, local_run, tmp_path):
  """load_parameters_path=gs://… and output_path=gs://…: the files equal the local export's."""
  del killed_and_resumed
  from MaxText.checkpoint_conversion import to_huggingface
  from MaxText.storage import paths
  local_dir, _, _ = local_run
  assert to_huggingface.main([f"load_parameters_path={local_dir}/checkpoints",
                              f"output_path={tmp_path / 'hf'}"]) == 0
  assert to_huggingface.main([f"load_parameters_path={OUT}/run/checkpoints",
                              f"output_path={OUT}/hf", "max_shard_gb=0.0001"]) == 0
  remote = paths.files_under(f"{OUT}/hf")
  assert not any(n.startswith(".") for n in remote)          # no temporary shard left
  assert to_huggingface.main([f"load_parameters_path={local_dir}/checkpoints",
                              f"output_path={tmp_path / 'hf_sharded'}", "max_shard_gb=0.0001"]) == 0
  local = sorted(os.listdir(tmp_path / "hf_sharded"))
  assert sorted(remote) == local and len(local) > 3          # several shards and their index
  for name in local:
    assert paths.read_bytes(f"{OUT}/hf/{name}") == (tmp_path / "hf_sharded" / name).read_bytes()


def test_paths_on_the_store(store):
  """The store layer itself: a conditional create, listings, a glob of data files read as the
  local files are."""
  from MaxText.data import file_readers, sources
  from MaxText.storage import paths
  _, local = store
  url = f"gs://{BUCKET}/paths/once"
  assert paths.create_new(url, b"first") and not paths.create_new(url, b"second")
  assert paths.read_bytes(url) == b"first"
  paths.remove(url)
  assert not paths.exists(url) and paths.create_new(url, b"third")
  found = sources.resolve_dataset_files(f"gs://{BUCKET}/data/*.parquet", "auto")
  assert found == [(f"gs://{BUCKET}/data/{n}.parquet", "parquet") for n in ("a", "b")]
  assert sources.resolve_dataset_files(f"gs://{BUCKET}/data", "auto") == found
  for (url, fmt), name in zip(found, ("a", "b")):
    remote = file_readers.make_reader(url, fmt, "text")
    here = file_readers.make_reader(str(local / f"{name}.parquet"), fmt, "text")
    assert len(remote) == len(here) == 40
    assert [remote[i] for i in range(40)] == [here[i] for i in range(40)]
  with pytest.raises(Exception, match="does not exist"):
    sources.resolve_dataset_files(f"gs://{BUCKET}/nothing-here.parquet", "auto")


def test_a_closed_tensorboard_event_file_is_not_uploaded_again(store, monkeypatch):
  """tensorboardX's gs:// event file uploads itself from `__del__` too, and its writer stays
  alive until the interpreter exits (an atexit hook holds it): once closed with the run
  (MetricsWriter.close), its `__del__` uploads nothing more (at the exit of a process whose store
  has gone, such an upload retried for minutes)."""
  import gc
  from google.cloud import storage
  from tensorboardX import record_writer
  from MaxText.metrics.writers import MetricsWriter
  from MaxText.storage import paths
  uploads = []
  real = storage.Blob.upload_from_string
  monkeypatch.setattr(storage.Blob, "upload_from_string",
                      lambda blob, *a, **kw: (uploads.append(blob.name), real(blob, *a, **kw))[1])
  writer = MetricsWriter(f"{OUT}/tb-once", enable_tensorboard=True, is_primary=True)
  writer.write(1, {"loss": 2.5})
  writer.close()
  assert uploads and all("/tb-once/tensorboard/events.out.tfevents" in n for n in uploads), uploads
  assert any(n.startswith("events.out.tfevents") for n in paths.listdir(f"{OUT}/tb-once/tensorboard"))
  closed = len(uploads)
  live = [o for o in gc.get_objects() if issubclass(type(o), record_writer.GCSRecordWriter)
          and "/tb-once/" in o.path]
  assert live   # the atexit hook's
  for gcs_writer in live:
    gcs_writer.__del__()   # what the interpreter's exit does
  assert len(uploads) == closed, uploads


def test_the_emulator_started_by_hand_prints_its_settings_and_buckets():
  """`python tests/gcs_emulator.py NAME`, as docs/training.md says to start it: the exports, then
  the bucket's name; Ctrl-C stops it."""
  p = subprocess.Popen([sys.executable, "tests/gcs_emulator.py", "mine"], cwd=ROOT,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    assert p.stdout is not None
    lines = []
    for line in p.stdout:
      lines.append(line)
      if line.startswith("#"):
        break
    p.send_signal(signal.SIGINT)
    # both pipes drained while it stops (a full stderr pipe would block its exit); the server's
    # stop is bounded (terminate, then kill after 10 s), a loaded machine slow
    _, err = p.communicate(timeout=120)
  finally:
    p.kill()
  assert any(l.startswith("export STORAGE_EMULATOR_HOST=http://127.0.0.1:") for l in lines), lines
  assert lines[-1].startswith("# bucket: gs://mine ") and "base_output_directory=gs://mine" in lines[-1]
  assert p.returncode == 0, err


def test_files_under_leaves_out_a_file_that_vanishes_while_listed(tmp_path, monkeypatch):
  """Another process's transient lock file listed and gone before its size is read (a
  multi-process Orbax save) is not under the directory any more: left out, not an error."""
  from MaxText.storage import paths
  (tmp_path / "a").mkdir()
  (tmp_path / "a" / "kept.bin").write_bytes(b"12345")
  (tmp_path / "a" / "manifest.ocdbt.__lock").write_bytes(b"")
  real_getsize = os.path.getsize

  def getsize(path):
    if path.endswith("__lock"):
      os.remove(path)          # gone between os.walk's listing and the size
    return real_getsize(path)

  monkeypatch.setattr(os.path, "getsize", getsize)
  assert paths.files_under(str(tmp_path)) == {"a/kept.bin": 5}
