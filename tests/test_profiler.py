"""The step profiler (`profiler=xplane`, MaxText/metrics/profiler.py): a run traces the window of
steps it is asked for, the reader turns an XSpace into each op's own time per step and category,
and the keys refuse what would trace nothing or be ignored."""
import os
import shlex
import subprocess
import sys

import jax
import pytest

from conftest import BASE_YML, ROOT, train
from MaxText.config.load import ConfigError, load_config
from MaxText.metrics import profiler
from MaxText.resolve.config_checks import validate

# A TPU-shaped trace: two runs of the step program (10 us each); in the first, a `while` of 8 us
# that runs a 3 us matmul fusion, then a 1 us copy; in the second, the fusion alone (4 us).
TPU_TRACE = '''
planes {
  id: 1
  name: "/device:TPU:0"
  lines { id: 1 name: "XLA Modules" timestamp_ns: 0
    events { metadata_id: 1 offset_ps: 0 duration_ps: 10000000 }
    events { metadata_id: 1 offset_ps: 20000000 duration_ps: 10000000 } }
  lines { id: 2 name: "XLA Ops" timestamp_ns: 0
    events { metadata_id: 2 offset_ps: 0 duration_ps: 8000000 }
    events { metadata_id: 3 offset_ps: 1000000 duration_ps: 3000000 }
    events { metadata_id: 4 offset_ps: 8000000 duration_ps: 1000000 }
    events { metadata_id: 3 offset_ps: 20000000 duration_ps: 4000000 } }
  event_metadata { key: 1 value { id: 1 name: "jit_step(7)" } }
  event_metadata { key: 2 value { id: 2 name: "%while.5 = (s32[]) while(s32[] %a), body=%b" } }
  event_metadata { key: 3 value { id: 3 name: "%fusion.7 = bf16[8,16]{1,0:T(8,128)} fusion(bf16[8] %x), kind=kOutput, calls=%f" } }
  event_metadata { key: 4 value { id: 4 name: "%copy.2 = bf16[16,8]{1,0} copy(bf16[16,8]{0,1} %y)" } }
}
'''


def test_the_reader_gives_each_ops_own_time_per_step():
  from jax.profiler import ProfileData  # pylint: disable=import-outside-toplevel
  (dev,) = profiler.summarize(ProfileData.from_text_proto(TPU_TRACE))
  assert (dev.device, dev.steps, dev.step_module) == ("/device:TPU:0", 2, "jit_step(7)")
  assert dev.step_ns == pytest.approx(10_000)
  ops = {op.name: op for op in dev.ops}
  assert set(ops) == {"while.5", "fusion.7", "copy.2"}
  assert ops["fusion.7"].ns == pytest.approx(7_000) and ops["fusion.7"].count == 2
  assert ops["while.5"].ns == pytest.approx(5_000)    # 8 us less the fusion it ran
  assert ops["copy.2"].ns == pytest.approx(1_000)
  assert dev.ops[0].name == "fusion.7"                # largest first
  assert dev.categories() == pytest.approx({"fusion: matmul (output fusion)": 3_500,
                                            "while": 2_500, "data formatting": 500})
  assert "kind=kOutput" in ops["fusion.7"].text
  report = profiler.report(dev)
  assert "| fusion.7 | fusion: matmul (output fusion) | 0.004 | 1 |" in report, report


def test_the_keys_refuse_what_would_be_ignored_or_trace_nothing(tmp_path):
  base = [BASE_YML, f"base_output_directory={tmp_path}"]
  cpu = jax.devices()[:1]
  with pytest.raises(ConfigError, match="profiler_steps=3: applies only with profiler=xplane"):
    validate(load_config([*base, "profiler_steps=3"]), cpu)
  with pytest.raises(ConfigError, match="skip_first_n_steps_for_profiler=4: applies only"):
    validate(load_config([*base, "skip_first_n_steps_for_profiler=4"]), cpu)
  with pytest.raises(ConfigError, match="steps=5, so profiler=xplane would trace nothing"):
    validate(load_config([*base, "profiler=xplane", "steps=5",
                          "skip_first_n_steps_for_profiler=5"]), cpu)
  with pytest.raises(ConfigError, match="profiler='tensorboard'"):
    load_config([*base, "profiler=tensorboard"])
  validate(load_config([*base, "profiler=xplane", "steps=5"]), cpu)   # the defaults: 1 + 5, clipped


def test_a_run_traces_the_steps_it_is_asked_for(tmp_path, capsys):
  code, rows, _ = train(tmp_path, "prof", "steps=4", "enable_checkpointing=false",
                        "sample_at_end=false", "profiler=xplane",
                        "skip_first_n_steps_for_profiler=1", "profiler_steps=2",
                        devices=jax.devices()[:1])
  assert code == 0 and [r["step"] for r in rows] == [1, 2, 3, 4]
  out_dir = os.path.join(tmp_path, "prof", profiler.PROFILE_DIR)
  assert f"profiler: steps 2-3 traced to {out_dir}" in capsys.readouterr().out
  files = profiler.xplane_files(out_dir)
  assert len(files) == 1
  (host,) = profiler.summarize(files[0])
  assert host.step_module == "jit_step" and host.steps == 2, (host.step_module, host.steps)
  assert sum(op.count for op in host.ops) > 0

  # the reader's command line, as docs/performance.md gives it (`summary RUN_DIR/profile`), and
  # `compare` of two such records
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  import tpu_profile  # pylint: disable=import-outside-toplevel
  assert tpu_profile.main(["summary", out_dir, "--top", "5"]) == 0
  text = capsys.readouterr().out
  assert "| category | ms / step |" in text and "| op | category | ms / step |" in text, text
  rec = tpu_profile.summarize_dir(out_dir, None, 10)
  assert rec["steps_traced"] == 2 and len(rec["top_ops"]) == 10
  assert sum(rec["by_runs_per_step_ms"].values()) == pytest.approx(rec["ops_ms"])
  side = tpu_profile.compare(dict(rec, trainer="ours"), dict(rec, trainer="maxtext"), 5)
  assert side.startswith("| | ours | maxtext |"), side


def test_the_side_by_side_command_profiles_both_trainers_with_the_same_keys():
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  import tpu_profile  # pylint: disable=import-outside-toplevel
  p = subprocess.run(["bash", "benchmarks/tpu_profile.sh", "--dry-run"], cwd=ROOT,
                     capture_output=True, text=True, check=False)
  assert p.returncode == 0, p.stderr
  lines = [line for line in p.stdout.splitlines() if line.startswith("[dry-run]")]
  assert [("tpu_profile.py maxtext" in l, "tpu_profile.py ours" in l) for l in lines] == [
      (True, False), (False, True)], lines
  ours = shlex.split(lines[1])[1:]
  keys = [k for k in ours[ours.index("--out") + 2:] if "=" in k]
  load_config([BASE_YML, *keys, *[f"{k}={v}" for k, v in tpu_profile.PROFILE_KEYS.items()]])


def test_a_family_rows_profile_takes_that_rows_keys_on_both_sides():
  """`TPU_PROFILE_ROW=moe16 bash benchmarks/tpu_profile.sh` (docs/performance.md): each side runs
  the row's keys from benchmarks/tpu_family_rows.py; an unknown row exits 2."""
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  import tpu_family_rows as rows  # pylint: disable=import-outside-toplevel
  env = {**os.environ, "TPU_PROFILE_ROW": "moe16"}
  p = subprocess.run(["bash", "benchmarks/tpu_profile.sh", "--dry-run"], cwd=ROOT, env=env,
                     capture_output=True, text=True, check=False)
  assert p.returncode == 0, p.stderr
  lines = [line for line in p.stdout.splitlines() if line.startswith("[dry-run]")]
  for line, side in zip(lines, ("maxtext", "ours")):
    args = shlex.split(line)
    keys = args[args.index("--out") + 2:]
    assert keys[:len(rows.side_keys(rows.ROWS["moe16"], side))] == rows.side_keys(
        rows.ROWS["moe16"], side), (side, keys)
  bad = subprocess.run(["bash", "benchmarks/tpu_profile.sh", "--dry-run"], cwd=ROOT,
                       env={**os.environ, "TPU_PROFILE_ROW": "nope"}, capture_output=True,
                       text=True, check=False)
  assert bad.returncode == 2 and "no row 'nope'" in bad.stderr, bad.stderr


def test_a_trace_goes_to_an_object_store_and_a_failing_trace_never_stops_the_run(tmp_path,
                                                                                  monkeypatch):
  """On an object-store run directory the trace is written locally and copied there; a trace that
  cannot start or be written is logged and the run goes on (the step after it is not lost)."""
  from MaxText.storage import paths  # pylint: disable=import-outside-toplevel
  logged: list[str] = []
  calls: list[str] = []

  def start(d):
    calls.append("start")
    os.makedirs(os.path.join(d, "plugins", "profile", "t"))
    with open(os.path.join(d, "plugins", "profile", "t", "h.xplane.pb"), "wb") as f:
      f.write(b"xspace")

  monkeypatch.setattr(jax.profiler, "start_trace", start)
  monkeypatch.setattr(jax.profiler, "stop_trace", lambda: calls.append("stop"))
  store = "memory://runs/prof"
  prof = profiler.StepProfiler(2, 3, paths.join(store, profiler.PROFILE_DIR), logged.append)
  for step in (1, 2, 3, 4):
    prof.before_step(step, None)
    prof.after_step(step, None)
  assert calls == ["start", "stop"]
  assert paths.read_bytes(f"{store}/profile/plugins/profile/t/h.xplane.pb") == b"xspace"
  assert logged == [f"profiler: steps 2-3 traced to {store}/profile (xplane; TensorBoard's "
                    f"profile plugin or xprof reads it, `python benchmarks/tpu_profile.py summary "
                    f"{store}/profile` prints its ops)"]

  def fail():
    raise OSError("disk full")
  monkeypatch.setattr(jax.profiler, "stop_trace", fail)
  logged.clear()
  prof = profiler.StepProfiler(1, 1, str(tmp_path / "p"), logged.append)
  prof.before_step(1, None)
  prof.after_step(1, None)
  assert len(logged) == 1 and "was not written" in logged[0] and "disk full" in logged[0], logged
  monkeypatch.setattr(jax.profiler, "start_trace", lambda d: fail())
  logged.clear()
  prof = profiler.StepProfiler(1, 1, str(tmp_path / "q"), logged.append)
  prof.before_step(1, None)
  prof.after_step(1, None)    # nothing started: nothing to stop
  assert len(logged) == 1 and "could not start the trace" in logged[0], logged
