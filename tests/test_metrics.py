"""Tests for MaxText.metrics: FLOP counting, device peaks, and metric writers."""

import glob
import json
import os
import struct
import dataclasses
import math
import re
import types

import jax
import numpy as np
import pytest

from conftest import BASE_YML
from MaxText.config.load import load_config
from MaxText.metrics import flops, peaks, writers
from MaxText.models.model_config import ModelConfig
from MaxText.models.registry import make_model_def, model_flops, training_flops

# The reference config MaxText 0.2.5 was run with (see /work/shared/notes).
REF_DIMS = dict(emb_dim=256, num_decoder_layers=4, num_query_heads=4, num_kv_heads=4, head_dim=64,
                mlp_dim=1024, vocab_size=8192, tie_word_embeddings=False)
_BASE_MODEL = ModelConfig.from_config(load_config([BASE_YML]))


def dims(**changes):
  return dataclasses.replace(_BASE_MODEL, **{**REF_DIMS, **changes})


REF_MODEL = dims()
REF_STEP = dict(seq_len=256, global_batch=8)


def matmul_params(m) -> int:
  return model_flops(m, 256).matmul_params


def test_reference_param_counts():
  # 4 layers * (4*256*256 attn + 3*256*1024 mlp) + 256*8192 head.
  assert matmul_params(REF_MODEL) == 6_291_456
  # + input embedding 8192*256 + (2*4+1)*256 norm scales = MaxText's reported count: the model's
  # own parameters add up to it
  total = lambda m: sum(math.prod(a.shape) for a in jax.tree.leaves(make_model_def(m).abstract_params))
  assert total(REF_MODEL) == 8_390_912
  assert total(dims(tie_word_embeddings=True)) == 8_390_912 - 8192 * 256


def test_reference_training_flops():
  out = training_flops(REF_MODEL, **REF_STEP)
  tokens = 8 * 256
  assert out["tokens"] == tokens
  assert out["matmul"] == 6 * 6_291_456 * tokens == 77_309_411_328
  # 4 layers * 3 (fwd+bwd) * 4*B*S^2*H*h / 2 (causal).
  assert out["attention"] == 4 * 3 * 4 * 8 * 256**2 * 4 * 64 / 2 == 3_221_225_472
  # Exact figure 80,530,636,800 FLOPs; MaxText 0.2.5 logs 0.0805 TFLOP per step for
  # this config, i.e. the same count (it also uses 6*N*T plus halved causal attention).
  assert out["total"] == 80_530_636_800
  assert out["tflops"] == pytest.approx(0.0805, abs=5e-5)


def test_causal_attention_is_half_of_noncausal():
  causal = training_flops(REF_MODEL, **REF_STEP, causal=True)
  full = training_flops(REF_MODEL, **REF_STEP, causal=False)
  assert full["attention"] == 2 * causal["attention"]
  assert full["matmul"] == causal["matmul"]
  assert full["total"] - causal["total"] == causal["attention"]


def test_gqa_changes_the_count():
  gqa = dims(num_kv_heads=1)
  # k and v shrink from 4 heads to 1: 2 * 256 * 3 * 64 fewer weights per layer.
  assert matmul_params(REF_MODEL) - matmul_params(gqa) == 4 * 2 * 256 * 3 * 64


def _stacked(model_def):
  """path → whether the leaf has a stacked "layers" axis (its logical axes say so)."""
  return {p: "layers" in axes for p, axes in
          jax.tree_util.tree_flatten_with_path(model_def.logical_axes,
                                               is_leaf=lambda x: isinstance(x, tuple))[0]}


@pytest.mark.parametrize("model_name", ["qwen3-tiny", "gemma4-tiny"])
def test_matmul_params_equal_the_models_matrices(model_name):
  """The family's count equals the model's own weight matrices (all >= 2-D parameters but the
  gathered embedding tables), plus the head when it is tied to the embedding."""
  m = ModelConfig.from_config(load_config([BASE_YML, f"model_name={model_name}"]))
  model_def = make_model_def(m)
  stacked = _stacked(model_def)
  count = 0
  for path, a in jax.tree_util.tree_flatten_with_path(model_def.abstract_params)[0]:
    name = str(path[-1].key)
    if name in ("embedding", "ple_embedding") or a.ndim - stacked[path] < 2:
      continue
    count += math.prod(a.shape)
  count += m.emb_dim * m.vocab_size if m.tie_word_embeddings else 0
  assert matmul_params(m) == count


@pytest.mark.parametrize("model_name,overrides,active_b", [
    ("qwen3-30b-a3b", (), 3.3), ("gemma4-26b-a4b", (), 3.8),
    # DeepSeek-style: the first 4 layers dense; their 6144-wide MLP has as many weights as the 8
    # active experts of width 768 (3*D*6144 = 8*3*D*768), so the active size stays 3.3B
    ("qwen3-30b-a3b", ("first_k_dense_layers=4",), 3.3)])
def test_moe_flops_count_active_experts_only(model_name, overrides, active_b):
  """Matmul parameters = the model's layer matrices with experts counted k/E, plus the LM head
  (Qwen: experts replace the MLP; Gemma 4: they add to it)."""
  m = ModelConfig.from_config(load_config([BASE_YML, f"model_name={model_name}", *overrides]))
  leaves = jax.tree_util.tree_flatten_with_path(make_model_def(m).abstract_params)[0]
  experts = sum(math.prod(a.shape) for p, a in leaves if "experts" in str(p))
  layers = sum(math.prod(a.shape) for p, a in leaves if "decoder" in str(p) and a.ndim >= 3)
  active = layers - experts * (1 - m.num_experts_per_tok / m.num_experts)   # [L, ...] matrices
  assert matmul_params(m) == active + m.emb_dim * m.vocab_size   # + the LM head
  assert abs(matmul_params(m) / 1e9 - active_b) < 0.1 * active_b


def test_sliding_window_attention_flops():
  full = dims(num_decoder_layers=2, decoder_block="gemma4", use_qk_norm=True)
  mixed = dims(num_decoder_layers=2, decoder_block="gemma4", use_qk_norm=True,
               attention_pattern="sf", sliding_window=64)
  a, b = (training_flops(x, **REF_STEP)["attention"] for x in (full, mixed))
  S, W = REF_STEP["seq_len"], 64
  per_layer = a / 2
  assert b == per_layer + per_layer * (S * W - W * (W - 1) / 2) / (S * S / 2)


def test_flops_rejects_nonpositive_sizes():
  for step in (dict(seq_len=0, global_batch=8), dict(seq_len=256, global_batch=0)):
    with pytest.raises(ValueError, match="must be positive"):
      training_flops(REF_MODEL, **step)
  with pytest.raises(ValueError, match="matmul_params must be positive"):
    flops.training_flops_per_step(flops.FlopCount(0, 0.0), seq_len=8, global_batch=1)


def _dev(kind, platform="gpu"):
  return types.SimpleNamespace(device_kind=kind, platform=platform)


@pytest.mark.parametrize("kind,expected", [
    ("NVIDIA H100 80GB HBM3", 989.0),
    ("NVIDIA H200", 989.0),
    ("NVIDIA A100-SXM4-80GB", 312.0),
    ("TPU v5 lite", 197.0),
    ("TPU v5e", 197.0),
    ("TPU v5p", 459.0),
    ("TPU v5", 459.0),
    ("TPU v6 lite", 918.0),
    ("TPU v6e", 918.0),
])
def test_peak_table_lookup(kind, expected):
  platform = "tpu" if kind.startswith("TPU") else "gpu"
  assert peaks.device_peak_tflops(_dev(kind, platform), 0.0) == (expected, "table", False)


def test_unknown_accelerator_has_no_peak():
  assert peaks.device_peak_tflops(_dev("Mystery Chip 9000"), 0.0) == (0.0, "unknown", False)


def test_override_wins():
  assert peaks.device_peak_tflops(_dev("NVIDIA H100 80GB HBM3"), 123.5) == (123.5, "config", False)
  assert peaks.device_peak_tflops(_dev("cpu", "cpu"), 7.0) == (7.0, "config", False)


def test_cpu_peak_is_measured_once_per_machine_and_cached(monkeypatch, tmp_path):
  cache = tmp_path / "peak.json"
  monkeypatch.setenv(peaks.CACHE_ENV, str(cache))
  monkeypatch.setattr(peaks, "_MEASURED_HOST_TFLOPS", {})
  monkeypatch.setattr(peaks.os, "getloadavg", lambda: (0.0, 0.0, 0.0))   # a quiet machine
  tflops, source, loaded = peaks.device_peak_tflops(_dev("cpu", "cpu"), 0.0, "bfloat16")
  assert "measured now, cached in" in source and str(cache) in source
  # A 2-core machine reaches well under 10 TFLOP/s but clearly more than nothing.
  assert 1e-4 < tflops < 10.0
  entry, = json.loads(cache.read_text()).values()
  assert entry["tflops"] == pytest.approx(tflops * jax.local_device_count())
  # Another process on the same machine (fresh in-process state) reads the file, never measures.
  monkeypatch.setattr(peaks, "_MEASURED_HOST_TFLOPS", {})
  monkeypatch.setattr(peaks.time, "perf_counter", lambda: pytest.fail("measured twice"))
  again, source, loaded_again = peaks.device_peak_tflops(_dev("cpu", "cpu"), 0.0, "bfloat16")
  assert again == tflops and "cached in" in source and "measured now" not in source
  assert not loaded and not loaded_again


def test_cpu_peak_measured_under_load_is_cached_marked_and_replaced_when_quiet(monkeypatch,
                                                                               tmp_path):
  cache = tmp_path / "peak.json"
  monkeypatch.setenv(peaks.CACHE_ENV, str(cache))
  monkeypatch.setattr(peaks, "_MEASURED_HOST_TFLOPS", {})
  monkeypatch.setattr(peaks.os, "getloadavg", lambda: (99.0, 99.0, 99.0))
  peak = peaks.device_peak_tflops(_dev("cpu", "cpu"), 0.0, "float32")
  assert peak.tflops > 0 and peak.under_load and "measured now under load 99.0" in peak.source
  entry, = json.loads(cache.read_text()).values()
  assert entry["under_load"] is True and entry["load"] == 99.0
  # the next run, still busy, reads the marked figure: no measurement, still marked
  monkeypatch.setattr(peaks, "_MEASURED_HOST_TFLOPS", {})
  with monkeypatch.context() as m:
    m.setattr(peaks.time, "perf_counter", lambda: pytest.fail("measured again under load"))
    again = peaks.device_peak_tflops(_dev("cpu", "cpu"), 0.0, "float32")
  assert again.tflops == peak.tflops and again.under_load and "under load" in again.source
  # a run on a quiet machine measures again and replaces it with an unmarked figure
  monkeypatch.setattr(peaks.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
  quiet = peaks.device_peak_tflops(_dev("cpu", "cpu"), 0.0, "float32")
  assert not quiet.under_load and "measured now, cached in" in quiet.source
  entry, = json.loads(cache.read_text()).values()
  assert entry["under_load"] is False


def test_an_mfu_against_a_peak_measured_under_load_says_so_on_its_line():
  from MaxText.train.step_rows import StepRows   # pylint: disable=import-outside-toplevel
  metrics = {"loss": np.float32(2.0), "finite": np.bool_(True)}
  plain = StepRows(1e9, 1.0, 64, 1).row(metrics)
  loaded = StepRows(1e9, 1.0, 64, 1, peak_under_load=True).row(metrics)
  assert "mfu_peak_under_load" not in plain and loaded["mfu_peak_under_load"] is True
  assert "(peak measured under load)" not in writers.format_line(1, plain, 9)
  line = writers.format_line(1, loaded, 9)
  assert re.search(r"MFU [0-9.]+% \(peak measured under load\)", line), line


def _read_tensorboard_scalars(path):
  """{(tag, step): value} from a TFRecord event file (8-byte length, 4-byte crc, data, 4-byte crc)."""
  from tensorboardX.proto import event_pb2  # pylint: disable=import-outside-toplevel

  with open(path, "rb") as f:
    data = f.read()
  scalars, pos = {}, 0
  while pos < len(data):
    (length,) = struct.unpack("<Q", data[pos:pos + 8])
    event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
    pos += 12 + length + 4
    for value in event.summary.value:
      scalars[(value.tag, event.step)] = value.simple_value
  return scalars


def _step_metrics(i):
  return {
      "loss": np.float32(3.5 - 0.1 * i), "lr": 1e-3, "grad_norm": np.float32(1.25),
      "step_time_s": 0.5, "tokens_per_s": 4096.0, "tflops_per_device": 0.08, "mfu": 0.123,
  }


def test_writer_jsonl_and_tensorboard(tmp_path):
  run_dir = str(tmp_path / "run")
  writer = writers.MetricsWriter(run_dir, enable_tensorboard=True, is_primary=True)
  for i in range(3):
    writer.write(i, _step_metrics(i))
  # Lines are flushed as they are written, before close().
  with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
    assert len(f.readlines()) == 3
  writer.close()

  with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
    records = [json.loads(line) for line in f]
  assert [r["step"] for r in records] == [0, 1, 2]
  for r in records:
    assert set(writers.REQUIRED_KEYS) <= set(r)
    assert all(type(r[k]) in (int, float) for k in writers.REQUIRED_KEYS)
  assert records[2]["loss"] == pytest.approx(3.3, rel=1e-6)

  events = glob.glob(os.path.join(run_dir, "tensorboard", "events.out.tfevents.*"))
  assert len(events) == 1
  scalars = _read_tensorboard_scalars(events[0])
  assert {tag for tag, _ in scalars} == set(writers.REQUIRED_KEYS) - {"step"}
  assert scalars[("loss", 2)] == pytest.approx(3.3, rel=1e-6)
  assert scalars[("mfu", 0)] == pytest.approx(0.123, rel=1e-6)


def test_resumed_writer_supersedes_rows_after_the_restored_step(tmp_path):
  """A run killed at step 5 after a checkpoint at 3, resumed from 3: metrics.jsonl ends with one
  row per step; the killed run's rows 4-5 (and a half-written line) go to
  metrics.superseded.jsonl; TensorBoard's events after 3 are purged on load (purge_step)."""
  run_dir = str(tmp_path / "run")
  with writers.MetricsWriter(run_dir, enable_tensorboard=True, is_primary=True) as writer:
    for i in range(1, 6):
      writer.write(i, _step_metrics(i))
  with open(os.path.join(run_dir, "metrics.jsonl"), "a", encoding="utf-8") as f:
    f.write('{"step": 6, "lo')                      # killed mid-line
  with writers.MetricsWriter(run_dir, enable_tensorboard=True, is_primary=True,
                             start_step=3) as writer:
    assert writer.superseded == 3
    for i in range(4, 8):
      writer.write(i, dict(_step_metrics(i), loss=100.0 + i))
  rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
  assert [r["step"] for r in rows] == list(range(1, 8))
  assert [r["loss"] for r in rows[3:]] == [104.0, 105.0, 106.0, 107.0]
  aside = open(os.path.join(run_dir, "metrics.superseded.jsonl")).read().splitlines()
  assert [json.loads(line)["step"] for line in aside[:2]] == [4, 5]
  assert aside[2] == '{"step": 6, "lo'
  # the second event file starts with a purge marker at step 4: TensorBoard drops older events
  # from step 4 on when it reads the directory
  events = sorted(glob.glob(os.path.join(run_dir, "tensorboard", "events.out.tfevents.*")))
  assert len(events) == 2
  assert _purge_steps(events[-1]) == [4]
  # a fresh start (step 0) supersedes everything that is there
  with writers.MetricsWriter(run_dir, enable_tensorboard=False, is_primary=True) as writer:
    assert writer.superseded == 7
  assert open(os.path.join(run_dir, "metrics.jsonl")).read() == ""


def _purge_steps(path):
  from tensorboardX.proto import event_pb2
  out = []
  with open(path, "rb") as f:
    data = f.read()
  pos = 0
  while pos < len(data):
    (length,) = struct.unpack("<Q", data[pos:pos + 8])
    event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
    pos += 12 + length + 4
    if event.HasField("session_log") and event.session_log.status == event.session_log.START:
      out.append(event.step)
  return out


def test_writer_nan_becomes_null(tmp_path):
  with writers.MetricsWriter(str(tmp_path), enable_tensorboard=False, is_primary=True) as writer:
    writer.write(0, dict(_step_metrics(0), loss=float("nan")))
  record = json.loads((tmp_path / "metrics.jsonl").read_text())
  assert record["loss"] is None
  assert not (tmp_path / "tensorboard").exists()


def test_non_primary_writes_nothing(tmp_path):
  run_dir = tmp_path / "run"
  writer = writers.MetricsWriter(str(run_dir), enable_tensorboard=True, is_primary=False)
  writer.write(0, _step_metrics(0))
  writer.close()
  assert not run_dir.exists()


def test_format_line_shows_the_parts_a_family_adds():
  """The progress line carries what the family's watcher shows (MoE: the expert load) after the
  learning rate, and nothing for a model without one."""
  from MaxText.metrics.moe_load import CollapseWatch
  base = {"loss": 3.0, "lr": 1e-3, "step_time_s": 0.5}
  watch = CollapseWatch(8, 2, balancing="", advice="")
  line = writers.format_line(5, {**base, "moe_load_max_over_mean": 3.9}, 9,
                             [watch.progress({**base, "moe_load_max_over_mean": 3.9})])
  assert "| lr 1.0e-03 | expert load 3.90 | 0.500 s |" in line
  assert watch.progress(base) == ""
  assert writers.format_line(5, base, 9, [watch.progress(base)]) == writers.format_line(5, base, 9)
  assert "expert load" not in writers.format_line(5, {**base, "moe_load_max_over_mean": 3.9}, 9)


def test_format_line():
  line = writers.format_line(12, {
      "loss": 3.45213, "lr": 1e-3, "grad_norm": 1.234, "step_time_s": 0.412,
      "tokens_per_s": 4970.2, "tflops_per_device": 2.1, "mfu": 0.123,
  }, 300)
  assert "\n" not in line
  assert line.startswith("step  12/300 |")
  for piece in ("loss 3.4521", "grad 1.23", "lr 1.0e-03", "0.412 s", "4,970 tok/s",
                "2.1 TFLOP/s/dev", "MFU 12.3%", "ETA 1m59s"):  # 288 steps left * 0.412 s
    assert piece in line, piece


def test_smoothed_loss_on_the_progress_line():
  smoother = writers.LossSmoother(horizon=4)
  assert smoother.update(float("nan")) is None           # nothing finite yet
  assert smoother.update(8.0) == pytest.approx(8.0)      # bias-corrected: the first loss itself
  got = [smoother.update(x) for x in (4.0, float("inf"), 4.0)]
  b = 0.75   # EMA weights 1-b, b(1-b), b^2(1-b) on 4, 4, 8, normalised by 1 - b^3
  assert got[-1] == pytest.approx(((1 - b) * 4 + b * (1 - b) * 4 + b * b * (1 - b) * 8) / (1 - b**3))
  assert got[1] == got[0]                                 # inf is left out
  line = writers.format_line(3, {"loss": 4.0, "loss_smoothed": got[-1]}, 10)
  assert f"loss 4.0000 (avg {got[-1]:.4f})" in line


def test_superseded_note_says_what_wrote_the_rows(tmp_path):
  """The note on rows moved aside tells a run that died (its stale lock was taken over) from one
  that ended normally without a checkpoint that far, and never calls either "interrupted"."""
  from MaxText.train.step_loop import superseded_note
  run_dir = str(tmp_path / "run")
  with writers.MetricsWriter(run_dir, enable_tensorboard=False, is_primary=True) as writer:
    for i in range(1, 7):
      writer.write(i, _step_metrics(i))
  with writers.MetricsWriter(run_dir, enable_tensorboard=False, is_primary=True,
                             start_step=4) as writer:
    assert writer.superseded_steps == [5, 6]
  dead = {"pid": 123, "host": "h", "since": "2026-12-02T14:00:00", "command": "train.py x"}
  assert superseded_note(writer, 4, dead, True) == (
      "metrics.jsonl: 2 rows (steps 5-6) written by a run that died without finishing (pid 123 "
      "on host h (since 2026-12-02T14:00:00: train.py x): it left its run lock behind, so it "
      "crashed, aborted or was killed) after its last checkpoint (step 4); moved to "
      "metrics.superseded.jsonl, recomputed from step 5")
  ended = superseded_note(writer, 4, None, True)
  assert "ended (it released its run lock) with no checkpoint after step 4" in ended
  off = superseded_note(writer, 0, None, False)
  assert "enable_checkpointing=false" in off and "recomputed from step 1" in off
  assert not any("interrupt" in note for note in (ended, off))


def test_the_tensorboard_writer_does_not_import_torch(tmp_path):
  """tensorboardX would import torch (seconds of every run's start-up); the writer hides it, and
  torch is still importable afterwards. In a fresh interpreter: this one may have torch loaded."""
  import subprocess   # pylint: disable=import-outside-toplevel
  import sys   # pylint: disable=import-outside-toplevel
  from conftest import ROOT   # pylint: disable=import-outside-toplevel
  code = (f"import sys; from MaxText.metrics.writers import MetricsWriter\n"
          f"w = MetricsWriter({str(tmp_path)!r}, enable_tensorboard=True, is_primary=True)\n"
          f"w.write(1, {{'loss': 2.5}}); w.flush(); w.close()\n"
          f"assert 'torch' not in sys.modules, 'torch was imported'\n"
          f"import importlib.util; assert importlib.util.find_spec('torch') is None or "
          f"__import__('torch') is not None\n")
  subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
  assert glob.glob(str(tmp_path / "tensorboard" / "events.out.tfevents.*"))
