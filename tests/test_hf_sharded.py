"""`train.py … hf_path=DIR`: a Hugging Face folder read straight onto the mesh, each process its own
slices (MaxText/resolve/hf_sharded.py), against the in-memory converter (to_maxtext's load_hf) and
a run from the converted checkpoint; 2 processes x 4 fake devices through MaxText.launch.local."""
import os
import re

import jax
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import ROOT, argv, read_metrics  # noqa: E402
from end_to_end.tiny_hf import save_tiny_tokenizer  # noqa: E402
from test_conversion import tiny_qwen3  # noqa: E402
from MaxText.checkpoint.manager import load_params_host  # noqa: E402
from MaxText.checkpoint_conversion import to_maxtext  # noqa: E402
from MaxText.config.load import replace  # noqa: E402
from MaxText.launch import local  # noqa: E402
from MaxText.models.model_config import ModelConfig  # noqa: E402
from MaxText.models.registry import get_hf_map, make_model_def  # noqa: E402
from MaxText.resolve import hf_sharded  # noqa: E402
from MaxText.sharding.mesh import create_mesh  # noqa: E402
from MaxText.sharding.rules import parse_rules, tree_shardings  # noqa: E402
from MaxText.train.loop import run  # noqa: E402

ARCH = ("emb_dim", "num_decoder_layers", "num_query_heads", "num_kv_heads", "head_dim", "mlp_dim",
        "vocab_size")
FSDP8 = ("per_device_batch_size=1", "ici_data_parallelism=1", "ici_fsdp_parallelism=8",
         "ici_tensor_parallelism=1")


def run_args(out, name, *overrides):
  """conftest's argv without the architecture keys (they come from config.json)."""
  return [a for a in argv(out, name, *overrides) if a.split("=")[0] not in ARCH]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  folder = tmp_path_factory.mktemp("hf") / "qwen3"
  tiny_qwen3(folder)
  save_tiny_tokenizer(folder)
  return folder


def _leaves(tree):
  return {jax.tree_util.keystr(p): np.asarray(a) for p, a in jax.tree_util.tree_leaves_with_path(tree)}


def _bitwise_equal(a, b):
  la, lb = _leaves(a), _leaves(b)
  assert sorted(la) == sorted(lb)
  for k in la:
    assert la[k].dtype == lb[k].dtype and la[k].shape == lb[k].shape, k
    assert la[k].tobytes() == lb[k].tobytes(), k


@pytest.mark.parametrize("scan", ["true", "false"])
def test_sharded_load_on_one_process_is_the_converters_bits(hf_dir, scan):
  cfg, ref = to_maxtext.load_hf(str(hf_dir), [f"scan_layers={scan}"])
  cfg = replace(cfg, ici_data_parallelism=2, ici_fsdp_parallelism=2, ici_tensor_parallelism=2)
  mcfg = ModelConfig.from_config(cfg)
  md = make_model_def(mcfg)
  sh = tree_shardings(md.logical_axes, md.abstract_params, create_mesh(cfg, jax.devices()),
                      parse_rules(cfg.logical_axis_rules, cfg.mesh_axes))
  abstract = jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h),
                          md.abstract_params, sh)
  got, stats = hf_sharded.load_sharded(str(hf_dir), get_hf_map("qwen3"), mcfg, abstract)
  _bitwise_equal(got, ref)
  assert jax.tree.map(lambda a: a.sharding, got) == sh
  # one process holding every slice reads each array byte once (replicas share a read)
  assert stats.bytes == sum(a.nbytes for a in jax.tree.leaves(ref))


def _damaged(src, dst, drop=None, reshape=None):
  """A copy of the folder with one tensor left out or given another shape."""
  from safetensors.numpy import load_file, save_file
  os.makedirs(dst)
  for f in os.listdir(src):
    if f != "model.safetensors":
      os.symlink(os.path.join(src, f), os.path.join(dst, f))
  tensors = load_file(os.path.join(src, "model.safetensors"))
  if drop:
    del tensors[drop]
  if reshape:
    tensors[reshape] = tensors[reshape][:-1]
  save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})


def test_bad_folders_exit_before_compiling(hf_dir, tmp_path, capsys):
  name = "model.layers.1.mlp.down_proj.weight"
  _damaged(hf_dir, tmp_path / "missing", drop=name)
  code, _ = run(run_args(tmp_path, "a", *FSDP8, f"hf_path={tmp_path / 'missing'}"))
  err = capsys.readouterr().err
  assert code == 4 and f"no shard holds tensor '{name}'" in err, err
  _damaged(hf_dir, tmp_path / "short", reshape=name)
  code, _ = run(run_args(tmp_path, "b", *FSDP8, f"hf_path={tmp_path / 'short'}"))
  err = capsys.readouterr().err
  assert code == 4 and f"tensor '{name}' has shape" in err, err
  # the architecture is config.json's: another value set by the user is refused naming both
  code, _ = run([*run_args(tmp_path, "c", *FSDP8, f"hf_path={hf_dir}"), "emb_dim=128"])
  err = capsys.readouterr().err
  assert code == 2 and "emb_dim=128 disagrees with hf_path's config.json (emb_dim=64)" in err, err
  code, _ = run(run_args(tmp_path, "d", *FSDP8, f"hf_path={tmp_path / 'nowhere'}"))
  err = capsys.readouterr().err
  assert code == 2 and "config.json does not exist" in err, err
  assert not os.path.exists(tmp_path / "a" / "metrics.jsonl")


def test_two_processes_read_half_each_and_train_like_the_converted_checkpoint(hf_dir, tmp_path):
  """2 processes x 4 devices, parameters over fsdp=8: each process reads only its half of the
  array bytes; the parameters after step 1 (lr 0 at the first warmup step: unchanged) are the
  converter's bits; the first loss is that of a run from to_maxtext's checkpoint."""
  steps = ("steps=1", "checkpoint_period=1", "enable_checkpointing=true", "warmup_steps=2")
  logs = tmp_path / "logs"
  result = local.launch([os.path.join(ROOT, "train.py"),
                         *run_args(tmp_path, "mp", *FSDP8, *steps, f"hf_path={hf_dir}")],
                        2, devices_per_process=4, log_dir=str(logs), cwd=ROOT, timeout_s=400)
  text = {i: (logs / f"process_{i}.out").read_text() + (logs / f"process_{i}.err").read_text()
          for i in (0, 1)}
  assert [e.status for e in result.exits] == [0, 0], text[0][-3000:] + text[1][-3000:]
  cfg, ref = to_maxtext.load_hf(str(hf_dir), [])
  total = sum(a.nbytes for a in jax.tree.leaves(ref))
  read = {}
  for i in (0, 1):
    m = re.search(rf"\[process {i}/2\] read (\d+) bytes of {re.escape(str(hf_dir))} in (\d+) "
                  r"ranged reads", text[i])
    assert m, text[i][-3000:]
    read[i] = int(m.group(1))
  # each half, plus the small tensors every process holds whole (norm scales: replicated)
  replicated = sum(a.nbytes for a in jax.tree.leaves(ref) if a.ndim <= 2 and a.size < 1024)
  assert all(b <= total / 2 + replicated for b in read.values()), (read, total)
  assert read[0] + read[1] >= total
  print(f"array bytes {total}, read by process 0: {read[0]}, by process 1: {read[1]}")
  saved = load_params_host(str(tmp_path / "mp" / "checkpoints"),
                           make_model_def(ModelConfig.from_config(cfg)).abstract_params)
  _bitwise_equal(saved, ref)

  # the same first step from the converted checkpoint (one process, 8 devices)
  ckpt = tmp_path / "ckpt"
  assert to_maxtext.main([f"hf_path={hf_dir}", f"output_path={ckpt}"]) == 0
  code, _ = run(run_args(tmp_path, "conv", *FSDP8, *steps, f"load_parameters_path={ckpt}",
                         "enable_checkpointing=false", "data_shards=2"))   # as 2 processes read
  assert code == 0
  ours, theirs = read_metrics(tmp_path / "mp"), read_metrics(tmp_path / "conv")
  # the same bits in, the same batch; the loss's partial sums combine in another order across 2
  # processes than across 8 devices of one (the suite's level-0 compile shows it in the last bit):
  # a loss ~6 in fp32 (eps 1.19e-7, ulp 4.8e-7 there) within 2 ulps of its 8 per-device partial
  # sums' rounding; a wrong parameter or batch moves it by orders more
  np.testing.assert_allclose([r["loss"] for r in ours], [r["loss"] for r in theirs], rtol=2e-7)
  assert [r["batch_checksum"] for r in ours] == [r["batch_checksum"] for r in theirs]


def test_hf_path_on_the_object_store(hf_dir, tmp_path, capsys):
  """hf_path=gs://… on the emulator (tests/gcs_emulator.py): the headers and each slice are
  ranged reads through gcsfs; the parameters are the local folder's bits, the tokenizer comes
  along, and a run's first loss is the local folder's."""
  from gcs_emulator import GcsEmulator
  from MaxText.storage import paths
  (tmp_path / "gcs").mkdir()
  with GcsEmulator(str(tmp_path / "gcs")) as emulator:
    emulator.create_bucket("models")
    url = "gs://models/qwen3"
    for name in os.listdir(hf_dir):
      paths.copy_file(str(hf_dir / name), f"{url}/{name}")
    cfg, ref = to_maxtext.load_hf(str(hf_dir), [])
    cfg = replace(cfg, ici_fsdp_parallelism=8)
    mcfg = ModelConfig.from_config(cfg)
    md = make_model_def(mcfg)
    sh = tree_shardings(md.logical_axes, md.abstract_params, create_mesh(cfg, jax.devices()),
                        parse_rules(cfg.logical_axis_rules, cfg.mesh_axes))
    abstract = jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h),
                            md.abstract_params, sh)
    got, stats = hf_sharded.load_sharded(url, get_hf_map("qwen3"), mcfg, abstract)
    _bitwise_equal(got, ref)
    assert stats.bytes == sum(a.nbytes for a in jax.tree.leaves(ref))
    steps = ("steps=1", "enable_checkpointing=false")
    code, _ = run(run_args(tmp_path, "gs", *FSDP8, *steps, f"hf_path={url}"))
    out = capsys.readouterr().out
    assert code == 0 and "tokenizer: huggingface " in out and "hf-tokenizer-" in out, out
    code, _ = run(run_args(tmp_path, "local", *FSDP8, *steps, f"hf_path={hf_dir}"))
    assert code == 0
  assert [r["loss"] for r in read_metrics(tmp_path / "gs")] == \
      [r["loss"] for r in read_metrics(tmp_path / "local")]
