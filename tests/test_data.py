"""Tests for MaxText.data: tokenizers, sources, packing and the resumable pipeline."""

import json
import os
import sysconfig

from absl import flags
import numpy as np
import pytest

from MaxText.config.load import BASE_YML, ConfigError, load_config
from MaxText.config.schema import choices
from MaxText.data import BATCH_KEYS, DataConfig, DataError, make_data_iterator, validate_data_config
from MaxText.data import file_readers, packing, sources, tokenizers

from end_to_end import tiny_hf

# Grain worker processes read absl flags; pytest never parses them.
flags.FLAGS.mark_as_parsed()

SEQ = 64


def make_cfg(**overrides):
  """The data config of configs/base.yml, rows of SEQ tokens, with `overrides`."""
  return DataConfig(**{**vars(DataConfig()), "max_target_length": SEQ, **overrides})


def take(it, n):
  return [next(it) for _ in range(n)]


def assert_batches_equal(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert set(x) == set(y) == set(BATCH_KEYS)
    for k in BATCH_KEYS:
      assert x[k].dtype == y[k].dtype == np.int32
      np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def write_jsonl(path, texts, field="text"):
  with open(path, "w", encoding="utf-8") as f:
    for t in texts:
      f.write(json.dumps({field: t, "other": 1}) + "\n")


# ---- tokenizers --------------------------------------------------------------------------------


def test_byte_tokenizer_round_trip():
  tok = tokenizers.make_tokenizer("byte", "")
  assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (259, 0, 1, 2)
  assert tok.encode("Az") == [ord("A") + 3, ord("z") + 3]
  text = "héllo ✓ world\n"
  ids = tok.encode(text)
  assert len(ids) == len(text.encode("utf-8"))
  assert all(3 <= i < 259 for i in ids)
  assert tok.decode([tok.bos_id] + ids + [tok.eos_id, tok.pad_id]) == text


def test_make_tokenizer_errors():
  with pytest.raises(DataError, match="tokenizer_path '/x/y' does not exist"):
    tokenizers.make_tokenizer("huggingface", "/x/y")
  with pytest.raises(DataError, match="tokenizer_path '/nope.model' does not exist"):
    tokenizers.make_tokenizer("sentencepiece", "/nope.model")
  with pytest.raises(DataError, match="tokenizer_type 'gpt'"):
    tokenizers.make_tokenizer("gpt", "")


# ---- packing -----------------------------------------------------------------------------------

DOCS = [[10, 11, 12], [20, 21, 22, 23, 24], list(range(30, 40)), [50]]


def rows_as_lists(rows):
  return [{k: r[k].tolist() for k in BATCH_KEYS} for r in rows]


def test_packing_exact_arrays():
  rows = rows_as_lists(packing.rows_from_token_lists(DOCS, 8, packing=True))
  assert rows == [
      {"inputs": [10, 11, 20, 21, 22, 23, 30, 31],
       "targets": [11, 12, 21, 22, 23, 24, 31, 32],
       "inputs_segmentation": [1, 1, 2, 2, 2, 2, 3, 3],
       "inputs_position": [0, 1, 0, 1, 2, 3, 0, 1],
       "targets_segmentation": [1, 1, 2, 2, 2, 2, 3, 3]},
      # The rest of document 3 continues as a new segment with positions from 0;
      # the 1-token document [50] has no (input, target) pair and is dropped.
      {"inputs": [32, 33, 34, 35, 36, 37, 38, 0],
       "targets": [33, 34, 35, 36, 37, 38, 39, 0],
       "inputs_segmentation": [1, 1, 1, 1, 1, 1, 1, 0],
       "inputs_position": [0, 1, 2, 3, 4, 5, 6, 0],
       "targets_segmentation": [1, 1, 1, 1, 1, 1, 1, 0]},
  ]


def test_no_packing_exact_arrays():
  rows = rows_as_lists(packing.rows_from_token_lists(DOCS, 4, packing=False, pad_id=7))
  assert [r["inputs"] for r in rows] == [
      [10, 11, 7, 7], [20, 21, 22, 23], [30, 31, 32, 33], [34, 35, 36, 37], [38, 7, 7, 7]]
  assert [r["targets"] for r in rows] == [
      [11, 12, 7, 7], [21, 22, 23, 24], [31, 32, 33, 34], [35, 36, 37, 38], [39, 7, 7, 7]]
  assert [r["inputs_segmentation"] for r in rows] == [
      [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0]]
  assert [r["inputs_position"] for r in rows] == [
      [0, 1, 0, 0], [0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3], [0, 0, 0, 0]]
  assert all(r["targets_segmentation"] == r["inputs_segmentation"] for r in rows)


def test_tokenize_adds_bos_eos():
  tok = tokenizers.ByteTokenizer()
  pairs = packing.TokenizeToPairs(tok, add_bos=True, add_eos=True)("ab")
  assert isinstance(pairs, dict)
  assert pairs["inputs"].tolist() == [1, ord("a") + 3, ord("b") + 3]
  assert pairs["targets"].tolist() == [ord("a") + 3, ord("b") + 3, 2]
  assert packing.TokenizeToPairs(tok, add_bos=False, add_eos=False)("a") is None


def test_pipeline_rows_never_predict_across_documents():
  """On real text: targets are next tokens within a segment; the mask matches segments."""
  it = make_data_iterator(make_cfg(shuffle=False), 0, 1, 4)
  docs = [tokenizers.ByteTokenizer().encode(d) for d in
          (sources.embedded_source()[i] for i in range(3))]
  batches = take(it, 3)
  rows = [{k: b[k][r] for k in BATCH_KEYS} for b in batches for r in range(4)]
  # Unshuffled, the first row starts with bos + the first stdlib file.
  first = [1] + docs[0]
  assert rows[0]["inputs"][:SEQ].tolist() == first[:SEQ]
  assert rows[0]["targets"][:SEQ].tolist() == first[1:SEQ + 1]
  for row in rows:
    seg, pos = row["inputs_segmentation"], row["inputs_position"]
    np.testing.assert_array_equal(row["targets_segmentation"], seg)
    same = (seg[:-1] == seg[1:]) & (seg[1:] > 0)
    np.testing.assert_array_equal(row["targets"][:-1][same], row["inputs"][1:][same])
    np.testing.assert_array_equal(pos[1:][same], pos[:-1][same] + 1)
    assert np.all(seg > 0)  # Packed rows of an endless stream have no padding.


# ---- sources -----------------------------------------------------------------------------------


def test_embedded_source_non_empty_and_deterministic():
  files = sources.embedded_files()
  assert len(files) > 100
  assert files == sources.embedded_files()
  root = sysconfig.get_paths()["stdlib"]
  rel = [os.path.relpath(f, root) for f in files]
  assert rel == sorted(rel)
  assert any(f.endswith("/os.py") for f in files)
  for part in ("/site-packages/", "/test/", "/tests/", "/idlelib/"):
    assert not any(part in f for f in files), part
  assert all(os.path.getsize(f) <= 200_000 for f in files)
  ds = sources.document_dataset("embedded")
  assert len(ds) == len(files)
  with open(files[5], encoding="utf-8", errors="replace") as f:
    assert ds[5] == f.read()


def test_file_sources_read_back_known_docs(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq
  from array_record.python.array_record_module import ArrayRecordWriter

  write_jsonl(tmp_path / "a.jsonl", ["j0", "j1 ünï", "j2"])
  pq.write_table(pa.table({"text": ["p0", "p1", "p2", "p3", "p4"], "n": [0, 1, 2, 3, 4]}),
                 tmp_path / "b.parquet", row_group_size=2)
  (tmp_path / "c.txt").write_text("whole file\nis one doc\n", encoding="utf-8")
  writer = ArrayRecordWriter(str(tmp_path / "d.array_record"), "group_size:1")
  for rec in (b"plain text record", json.dumps({"text": "json record"}).encode()):
    writer.write(rec)
  writer.close()
  (tmp_path / "ignored.bin").write_bytes(b"\0")

  def read(path, fmt="auto"):
    ds = sources.document_dataset("file", str(path), fmt, "text")
    return [ds[i] for i in range(len(ds))]

  assert read(tmp_path / "a.jsonl") == ["j0", "j1 ünï", "j2"]
  assert read(tmp_path / "b.parquet") == ["p0", "p1", "p2", "p3", "p4"]
  assert read(tmp_path / "b.parquet")[::-1] == ["p4", "p3", "p2", "p1", "p0"]
  assert read(tmp_path / "c.txt") == ["whole file\nis one doc\n"]
  assert read(tmp_path / "d.array_record") == ["plain text record", "json record"]
  everything = ["j0", "j1 ünï", "j2", "p0", "p1", "p2", "p3", "p4", "whole file\nis one doc\n",
                "plain text record", "json record"]
  assert read(tmp_path) == everything  # Directory: known extensions, sorted by name.
  assert read(tmp_path / "*.jsonl") == ["j0", "j1 ünï", "j2"]  # Glob.


def test_file_source_errors_name_key_and_place(tmp_path):
  with pytest.raises(DataError, match="dataset_path '/no/such/file.jsonl' does not exist"):
    sources.document_dataset("file", "/no/such/file.jsonl", "auto", "text")
  with pytest.raises(DataError, match="dataset_path '.*\\*.parquet' matched no files"):
    sources.document_dataset("file", str(tmp_path / "*.parquet"), "auto", "text")
  with pytest.raises(DataError, match="dataset_format 'csv'"):
    sources.document_dataset("file", str(tmp_path), "csv", "text")
  (tmp_path / "x.bin").write_bytes(b"1")
  with pytest.raises(DataError, match="dataset_format 'auto' cannot tell"):
    sources.document_dataset("file", str(tmp_path / "x.bin"), "auto", "text")
  path = tmp_path / "bad.jsonl"
  path.write_text('{"text": "ok"}\n\n{"body": "no text"}\n', encoding="utf-8")
  ds = sources.document_dataset("file", str(path), "auto", "text")
  assert ds[0] == "ok"
  with pytest.raises(DataError, match=r"field 'text' is missing in .*bad.jsonl line 3"):
    ds[1]  # pylint: disable=pointless-statement


def test_missing_paths_raise_data_error_naming_key(tmp_path):
  with pytest.raises(DataError, match="tokenizer_path '/x/y' does not exist"):
    validate_data_config(make_cfg(tokenizer_type="huggingface", tokenizer_path="/x/y"))
  with pytest.raises(DataError, match=f"dataset_path '{tmp_path}/none' does not exist"):
    validate_data_config(make_cfg(dataset_type="file", dataset_path=f"{tmp_path}/none"))
  with pytest.raises(DataError, match="dataset_path '/x/y.jsonl' does not exist"):
    make_data_iterator(make_cfg(dataset_type="file", dataset_path="/x/y.jsonl"), 0, 1, 2)
  with pytest.raises(DataError, match="tokenizer has 259 ids but vocab_size=128"):
    validate_data_config(make_cfg(vocab_size=128))
  # types and allowed values are the schema's, checked once when the config is loaded
  with pytest.raises(ConfigError, match="dataset_type='hub': must be one of"):
    load_config([BASE_YML, "dataset_type=hub"])
  assert isinstance(validate_data_config(make_cfg()), tokenizers.ByteTokenizer)


def test_data_config_is_the_schemas_data_keys():
  cfg = load_config([BASE_YML, "packing=false", "max_target_length=32"])
  dcfg = DataConfig.from_config(cfg)
  assert dcfg.packing is False and dcfg.max_target_length == 32 and dcfg.vocab_size == 384
  assert set(vars(dcfg)) == {   # what the pipeline reads, and nothing else
      "dataset_type", "dataset_path", "dataset_format", "dataset_text_field", "tokenizer_type",
      "tokenizer_path", "add_bos", "add_eos", "packing", "shuffle", "data_shuffle_seed",
      "grain_worker_count", "max_bad_records", "max_target_length", "vocab_size",
      "eval_split_fraction", "sft", "sft_train_on_completion_only", "sft_overlong",
      "chat_template_path", "max_num_images_per_example", "max_num_audio_per_example",
      "max_audio_seconds"}
  # the implementation tables of allowed values are the schema's choices
  assert set(file_readers.READERS) == set(choices("dataset_format")) - {"auto"}
  assert set(tokenizers.TOKENIZER_TYPES) == set(choices("tokenizer_type"))


# ---- iterator: resume, sharding, shuffling, synthetic ------------------------------------------


@pytest.mark.parametrize("workers", [0, 1])
def test_iterator_resume_is_bitwise(workers):
  cfg = make_cfg(grain_worker_count=workers)
  it = make_data_iterator(cfg, 0, 1, 3)
  first = take(it, 3)
  state = json.loads(json.dumps(it.get_state()))
  expected = take(it, 2)
  it.close()
  resumed = make_data_iterator(cfg, 0, 1, 3)
  resumed.set_state(state)
  assert_batches_equal(take(resumed, 2), expected)
  resumed.close()
  # And the iterator does move: the resumed batches differ from the first ones.
  assert not np.array_equal(first[0]["inputs"], expected[0]["inputs"])


def test_resume_when_rows_end_on_document_boundaries(tmp_path):
  # bos + 15 bytes + eos = 16 pairs: each document fills one row exactly, so the
  # packer's checkpoint has no partial document (a state shape the JSON round trip
  # must preserve exactly).
  write_jsonl(tmp_path / "docs.jsonl", [f"exactly 15 b {i:02d}" for i in range(9)])
  cfg = make_cfg(dataset_type="file", dataset_path=str(tmp_path / "docs.jsonl"),
                 max_target_length=16)
  it = make_data_iterator(cfg, 0, 1, 2)
  take(it, 3)
  state = json.loads(json.dumps(it.get_state()))
  expected = take(it, 4)  # Crosses into the next epoch.
  resumed = make_data_iterator(cfg, 0, 1, 2)
  resumed.set_state(state)
  assert_batches_equal(take(resumed, 4), expected)
  assert np.all(expected[0]["inputs_position"] == np.arange(16))


def test_two_processes_disjoint_and_cover_all(tmp_path):
  texts = [f"document number {i:03d}" for i in range(10)]
  write_jsonl(tmp_path / "docs.jsonl", texts)
  cfg = make_cfg(dataset_type="file", dataset_path=str(tmp_path / "docs.jsonl"), packing=False,
                 add_bos=False, add_eos=True)
  tok = tokenizers.ByteTokenizer()
  seen = []
  for p in (0, 1):
    batches = take(make_data_iterator(cfg, p, 2, 1), 5)  # One epoch of this process's shard.
    seen.append({tok.decode(b["inputs"][0]) for b in batches})
    assert len(seen[-1]) == 5
  assert not seen[0] & seen[1]
  assert seen[0] | seen[1] == set(texts)


def test_shuffle_is_seeded_and_changes_per_epoch(tmp_path):
  texts = [f"doc {i:02d}" for i in range(12)]
  write_jsonl(tmp_path / "docs.jsonl", texts)
  tok = tokenizers.ByteTokenizer()

  def order(**kw):
    cfg = make_cfg(dataset_type="file", dataset_path=str(tmp_path / "docs.jsonl"),
                   packing=False, add_bos=False, **kw)
    return [tok.decode(b["inputs"][0]) for b in take(make_data_iterator(cfg, 0, 1, 1), 24)]

  plain = order(shuffle=False)
  assert plain == texts + texts
  shuffled = order(shuffle=True, data_shuffle_seed=1)
  assert shuffled == order(shuffle=True, data_shuffle_seed=1)
  assert shuffled != order(shuffle=True, data_shuffle_seed=2)
  assert sorted(shuffled[:12]) == sorted(shuffled[12:]) == texts
  assert shuffled[:12] != shuffled[12:] and shuffled[:12] != texts


def test_synthetic_shapes_ranges_and_determinism():
  cfg = make_cfg(dataset_type="synthetic", vocab_size=50, max_target_length=16, data_shuffle_seed=3)
  a = take(make_data_iterator(cfg, 0, 2, 4), 2)
  assert_batches_equal(a, take(make_data_iterator(cfg, 0, 2, 4), 2))
  other = next(make_data_iterator(cfg, 1, 2, 4))
  assert not np.array_equal(a[0]["inputs"], other["inputs"])
  for b in a:
    assert all(b[k].shape == (4, 16) and b[k].dtype == np.int32 for k in BATCH_KEYS)
    assert b["inputs"].min() >= 3 and b["inputs"].max() < 50
    assert b["targets"].min() >= 3 and b["targets"].max() < 50
    np.testing.assert_array_equal(b["targets"][:, :-1], b["inputs"][:, 1:])
    assert np.all(b["inputs_segmentation"] == 1) and np.all(b["targets_segmentation"] == 1)
    np.testing.assert_array_equal(b["inputs_position"], np.tile(np.arange(16), (4, 1)))
  assert len({b["inputs"].tobytes() for b in a}) == 2


# ---- bad records, iterator-state mismatch ------------------------------------------------------


def _with_bad_lines(tmp_path):
  """30 one-row documents; a copy with 3 unreadable lines (truncated JSON, no text field, a
  non-string text) at lines 6, 13 and 21."""
  good = [json.dumps({"text": f"document number {i:02d} " * 3}) for i in range(30)]
  bad = ['{"text": "truncated in the mid', '{"body": "no text field"}', '{"text": 7}']
  lines = list(good)
  for at, line in zip((5, 12, 20), bad):
    lines.insert(at, line)
  (tmp_path / "clean.jsonl").write_text("\n".join(good) + "\n", encoding="utf-8")
  (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
  return lambda name, **kw: make_cfg(dataset_type="file", dataset_path=str(tmp_path / name),
                                     packing=False, shuffle=False, **kw)


def test_bad_records_skipped_counted_and_bounded(tmp_path, capsys):
  """Under the limit the stream equals the clean file's, each skip is logged with its place; the
  count is part of the iterator state, so a resumed iterator hits the limit at the same record."""
  cfg = _with_bad_lines(tmp_path)
  it = make_data_iterator(cfg("bad.jsonl", max_bad_records=3), 0, 1, 2)
  epoch = take(it, 15)  # one document per row, two rows per batch: the whole file once
  assert_batches_equal(epoch, take(make_data_iterator(cfg("clean.jsonl"), 0, 1, 2), 15))
  skips = [l for l in capsys.readouterr().err.splitlines() if l.startswith("skipped bad record")]
  assert len(skips) == 3 and "bad.jsonl line 6 is not valid JSON" in skips[0]
  assert skips[1].startswith("skipped bad record 2/3") and "line 13" in skips[1]
  state = json.loads(json.dumps(it.get_state()))
  with pytest.raises(DataError, match=r"more than max_bad_records=3 bad records; the last, "
                                      r".*bad.jsonl line 6"):
    take(it, 5)  # the 4th bad record, in the second epoch
  resumed = make_data_iterator(cfg("bad.jsonl", max_bad_records=3), 0, 1, 2)
  resumed.set_state(state)
  with pytest.raises(DataError, match="more than max_bad_records=3"):
    take(resumed, 5)
  raised = make_data_iterator(cfg("bad.jsonl", max_bad_records=4), 0, 1, 2)  # limit may change
  raised.set_state(state)
  assert_batches_equal(take(raised, 5), epoch[:5])


def test_iterator_state_of_other_data_config_is_refused(tmp_path):
  cfg = _with_bad_lines(tmp_path)
  it = make_data_iterator(cfg("clean.jsonl"), 0, 1, 2)
  take(it, 2)
  state = json.loads(json.dumps(it.get_state()))
  for other, msg in ((make_data_iterator(cfg("clean.jsonl", add_bos=False), 0, 1, 2),
                      "add_bos: saved True, now False"),
                     (make_data_iterator(cfg("clean.jsonl"), 0, 1, 4),
                      "shard_batch_size: saved 2, now 4"),
                     (make_data_iterator(cfg("clean.jsonl"), 0, 2, 2), "data_shards: saved 1, now 2")):
    with pytest.raises(DataError, match=msg):
      other.set_state(state)
  with pytest.raises(DataError, match="no data config fingerprint"):
    make_data_iterator(cfg("clean.jsonl"), 0, 1, 2).set_state({"shards": state["shards"]})


def test_too_many_bad_records_in_training_exits_3(tmp_path, capsys):
  import jax
  from conftest import MESH_1, train
  cfg = _with_bad_lines(tmp_path)
  data = ("dataset_type=file", f"dataset_path={cfg('bad.jsonl').dataset_path}", "steps=2",
          "enable_checkpointing=false", *MESH_1)
  code, rows, _ = train(tmp_path, "strict", *data, devices=jax.devices()[:1])
  assert code == 3 and rows == []
  err = capsys.readouterr().err
  assert "data error: more than max_bad_records=0 bad records" in err
  assert "found before compiling (1 of its first 6 lines)" in err and "bad.jsonl line 6 is not" in err
  code, rows, _ = train(tmp_path, "tolerant", *data, "max_bad_records=3",
                        devices=jax.devices()[:1])
  assert code == 0 and len(rows) == 2


def test_shards_stack_into_one_batch_and_resume_on_another_process_count():
  """Shards 0 and 1 of 2 read by one iterator give, row block by row block, what two one-shard
  iterators (two processes) give; the two processes' saved states, merged, resume the two-shard
  iterator (one process) exactly where they were."""
  from MaxText.data import make_shard_iterator
  cfg = make_cfg(dataset_type="synthetic")  # rows unique by global index
  both = make_shard_iterator(cfg, [0, 1], 2, 3)
  halves = [make_data_iterator(cfg, p, 2, 3) for p in (0, 1)]
  for _ in range(3):
    b, h0, h1 = next(both), next(halves[0]), next(halves[1])
    for k in BATCH_KEYS:
      assert b[k].shape == (6, SEQ)
      np.testing.assert_array_equal(b[k], np.concatenate([h0[k], h1[k]]))
    assert not any(np.array_equal(h0["inputs"][i], h1["inputs"][j])
                   for i in range(3) for j in range(3))  # disjoint rows
  states = [json.loads(json.dumps(h.get_state())) for h in halves]
  merged = {"shards": {**states[0]["shards"], **states[1]["shards"]},
            "fingerprint": states[0]["fingerprint"]}
  resumed = make_shard_iterator(cfg, [0, 1], 2, 3)
  resumed.set_state(merged)
  assert_batches_equal(take(resumed, 2), take(both, 2))
  with pytest.raises(DataError, match=r"no position for data shard\(s\) \[1\]"):
    make_shard_iterator(cfg, [0, 1], 2, 3).set_state(states[0])
  with pytest.raises(DataError, match="consecutive"):
    make_shard_iterator(cfg, [0, 2], 3, 3)


@pytest.mark.parametrize("damage", ["not_parquet", "truncated"])
def test_unreadable_parquet_file_exits_3_naming_the_file(tmp_path, capsys, damage):
  import jax
  import pyarrow as pa
  import pyarrow.parquet as pq
  from conftest import MESH_1, train
  path = tmp_path / "data.parquet"
  if damage == "not_parquet":
    path.write_text("text\nthis is a CSV file with a .parquet name\n")
  else:
    pq.write_table(pa.table({"text": [f"document {i}" for i in range(200)]}), path)
    os.truncate(path, os.path.getsize(path) // 2)
  with pytest.raises(DataError, match=f"dataset_path: {path} is not a readable Parquet file"):
    sources.document_dataset("file", str(path), "auto", "text")
  code, rows, _ = train(tmp_path, "run", "dataset_type=file", f"dataset_path={path}", "steps=1",
                        "enable_checkpointing=false", *MESH_1, devices=jax.devices()[:1])
  err = capsys.readouterr().err
  assert code == 3 and rows == []
  assert f"data error: dataset_path: {path} is not a readable Parquet file" in err
  assert "Traceback" not in err


def test_training_takes_the_tokenizer_type_from_the_path_and_says_so(tmp_path, capsys):
  """tokenizer_path with the default tokenizer_type (auto) is used, not ignored; the log and
  config.yml name the type and file; a contradicting explicit type exits 2 before compiling."""
  import jax
  import yaml
  from conftest import MESH_1, train
  tiny_hf.save_tiny_tokenizer(tmp_path / "tok")
  run = (*MESH_1, "steps=1", "enable_checkpointing=false", "vocab_size=320",
         f"tokenizer_path={tmp_path / 'tok'}")
  code, rows, _ = train(tmp_path, "run", *run, devices=jax.devices()[:1])
  out = capsys.readouterr().out
  assert code == 0 and len(rows) == 1
  tok_file = tmp_path / "tok" / "tokenizer.json"
  assert (f"tokenizer: huggingface {tok_file} (tokenizer_type=auto; tokenizer.json of the "
          f"directory {tmp_path / 'tok'}; inferred from the file name: huggingface)") in out
  written = yaml.safe_load((tmp_path / "run" / "config.yml").read_text())
  assert (written["tokenizer_type"], written["tokenizer_path"]) == ("huggingface", str(tok_file))
  code, _, _ = train(tmp_path, "bad", *run, "tokenizer_type=sentencepiece",
                     f"tokenizer_path={tok_file}", devices=jax.devices()[:1])
  out, err = capsys.readouterr()
  assert code == 2 and "tokenizer_type='sentencepiece' contradicts tokenizer_path=" in err
  assert "compiled" not in out


# ---- the first records, checked before compiling (MaxText/data/probe.py) ------------------------
def _chat_lines(n):
  return [json.dumps({"messages": [{"role": "user", "content": f"hello {i}"},
                                   {"role": "assistant", "content": "hi"}]}) for i in range(n)]


def test_chat_data_given_to_train_py_exits_3_before_compiling_naming_line_1(tmp_path):
  """The command a user runs: chat records (`messages`) given to the plain-text pipeline are
  refused from the first line, before anything compiles (JAX logs every compile), with the hint
  that configs/sft.yml reads them; exit 3, bad data (README's exit table)."""
  import subprocess
  import sys
  from conftest import ROOT, TINY
  data = tmp_path / "chats.jsonl"
  data.write_text("\n".join(_chat_lines(200)) + "\n", encoding="utf-8")
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_LOG_COMPILES="1")
  p = subprocess.run([sys.executable, "train.py", "configs/base.yml", *TINY, "dataset_type=file",
                      f"dataset_path={data}", f"base_output_directory={tmp_path}/runs"],
                     cwd=ROOT, env=env, capture_output=True, text=True, check=False)
  assert p.returncode == 3, (p.stdout, p.stderr)
  error = [l for l in p.stderr.splitlines() if l.startswith("data error:")]
  assert len(error) == 1, p.stderr
  assert f"{data} line 1;" in error[0] and "configs/sft.yml" in error[0], error
  assert "more than max_bad_records=0 bad records" in error[0] and "found before compiling" in error[0]
  assert "compiled" not in p.stdout and "Compiling" not in p.stderr and "Traceback" not in p.stderr


def test_first_records_are_checked_up_front_at_their_line_and_the_rest_when_read(tmp_path):
  from MaxText.data.errors import BadRecordsError
  """The check before compiling reads the first lines of the first file in order, so the first bad
  one is named at its own line (blank lines counted) and up to max_bad_records are let through;
  a bad record beyond them is found when training reads it, named at its file and line (no
  "document <index>": with shuffling, the index says nothing of where in the file it is)."""
  good = [json.dumps({"text": f"document number {i:02d} " * 3}) for i in range(40)]
  early = tmp_path / "early.jsonl"
  early.write_text("\n".join([good[0], "", good[1], '{"body": "x"}', *good[2:]]) + "\n",
                   encoding="utf-8")
  with pytest.raises(DataError, match=r"max_bad_records=0 .*\(1 of its first 3 lines\); the "
                                      r"first, dataset_text_field 'text' is missing in .*early"
                                      r"\.jsonl line 4$"):
    validate_data_config(make_cfg(dataset_type="file", dataset_path=str(early)))
  validate_data_config(make_cfg(dataset_type="file", dataset_path=str(early), max_bad_records=1))
  late = tmp_path / "late.jsonl"
  late.write_text("\n".join([*good[:33], "{truncated", *good[33:]]) + "\n", encoding="utf-8")
  cfg = make_cfg(dataset_type="file", dataset_path=str(late), packing=False, shuffle=True)
  validate_data_config(cfg)   # line 34 is beyond the first records
  it = make_data_iterator(cfg, 0, 1, 2)
  with pytest.raises(DataError) as e:
    take(it, 41)
  assert str(e.value).startswith("more than max_bad_records=0 bad records; the last, "
                                 f"dataset_path: {late} line 34 is not valid JSON"), e.value
  # a file that is not of its format is bad data too (exit 3), found before compiling
  (tmp_path / "x.array_record").write_bytes(b"not an ArrayRecord file")
  with pytest.raises(BadRecordsError, match=r"x\.array_record is not a readable ArrayRecord"):
    validate_data_config(make_cfg(dataset_type="file", dataset_path=str(tmp_path / "x.array_record")))
  # a chat record's own message says where chat data is read, whenever it is met
  with pytest.raises(DataError, match=r"line 1; it holds `prompt` and `completion`, the chat "
                                      r"format: .*configs/sft.yml"):
    file_readers.text_from_record({"prompt": "a", "completion": "b"}, "x.jsonl line 1", "text")
