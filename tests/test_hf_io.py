"""Safe Hugging Face folder I/O: safetensors only, no remote code, shard paths confined,
sharded export that reads back identically."""
import json
import os

import numpy as np
import pytest
from safetensors.numpy import save_file

from MaxText.checkpoint_conversion.hf_io import (HFFolderError, HFTensors, read_config,
                                                 write_hf_folder)


def _tensors():
  rng = np.random.default_rng(0)
  return {f"model.layers.{i}.w": rng.normal(size=(64, 32)).astype(np.float32) for i in range(5)}


def test_sharded_round_trip_and_lazy_reading(tmp_path):
  tensors = _tensors()
  write_hf_folder(str(tmp_path), tensors, {"model_type": "x"}, max_shard_bytes=3 * 64 * 32 * 4)
  files = sorted(os.listdir(tmp_path))
  assert files == ["config.json", "model-00001-of-00002.safetensors",
                   "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
  back = HFTensors(str(tmp_path))
  assert sorted(back) == sorted(tensors)
  for name, t in tensors.items():
    np.testing.assert_array_equal(back[name], t)
  assert read_config(str(tmp_path)) == {"model_type": "x"}


def test_single_file_export(tmp_path):
  write_hf_folder(str(tmp_path), _tensors(), {"model_type": "x"})
  assert "model.safetensors" in os.listdir(tmp_path)
  assert len(HFTensors(str(tmp_path))) == 5


def test_remote_code_and_missing_config_are_refused(tmp_path):
  with pytest.raises(HFFolderError, match="config.json does not exist"):
    read_config(str(tmp_path))
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "x", "auto_map": {"A": "b.C"}}))
  with pytest.raises(HFFolderError, match="auto_map"):
    read_config(str(tmp_path))


def test_pickle_only_folder_is_refused_without_reading(tmp_path):
  (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
  with pytest.raises(HFFolderError, match="pickle files .*pytorch_model.bin.* never loaded"):
    HFTensors(str(tmp_path))


def test_index_paths_must_stay_inside_the_folder(tmp_path):
  outside = tmp_path / "outside.safetensors"
  save_file({"w": np.zeros(2, np.float32)}, str(outside))
  model = tmp_path / "model"
  model.mkdir()
  for shard in ("../outside.safetensors", str(outside)):
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": shard}}))
    with pytest.raises(HFFolderError, match="escapes the model folder"):
      HFTensors(str(model))


def test_missing_shard_and_missing_tensor_are_named(tmp_path):
  (tmp_path / "model.safetensors.index.json").write_text(
      json.dumps({"weight_map": {"a": "model-1.safetensors"}}))
  with pytest.raises(HFFolderError, match="model-1.safetensors.*missing"):
    HFTensors(str(tmp_path))
  save_file({"b": np.zeros(2, np.float32)}, str(tmp_path / "model-1.safetensors"))
  with pytest.raises(HFFolderError, match="tensor 'a'"):
    HFTensors(str(tmp_path))["a"]


def test_reading_and_writing_show_progress(tmp_path, capsys):
  """About every tenth of the tensors (and the last) prints a line: a large model takes minutes."""
  rng = np.random.default_rng(0)
  tensors = {f"t{i:02d}": rng.normal(size=(10, 100)).astype(np.float32) for i in range(25)}
  write_hf_folder(str(tmp_path), tensors, {"model_type": "x"})
  lines = capsys.readouterr().out.splitlines()
  assert [line.split(": ")[1].split(" ")[0] for line in lines] == \
      ["3/25", "6/25", "9/25", "12/25", "15/25", "18/25", "21/25", "24/25", "25/25"]
  assert lines[-1].startswith(f"writing {tmp_path}: 25/25 tensors, 0.10 MB, ")
  back = HFTensors(str(tmp_path))
  for name in sorted(back):
    back[name]  # pylint: disable=pointless-statement
  lines = capsys.readouterr().out.splitlines()
  assert len(lines) == 9 and lines[-1].startswith(f"reading {tmp_path}: 25/25 tensors, 0.10 MB")
