"""hf_path= for every family: a tiny Hugging Face folder of each (Qwen3-MoE as the hub writes it
and in transformers' fused form, Qwen3-Next with tied embeddings, linear and full layers, dense and
MoE MLPs and an MTP block, Gemma 4 with its vision and audio towers) read onto the mesh a box at a
time (MaxText/resolve/hf_sharded.py) gives to_maxtext's parameters bit for bit — on one process
(8 devices, both parameter layouts) and on 2 processes x 4 devices (MaxText.launch.local), each
process reading its slices only. Also: the tied-embedding rule of the in-memory converter (a
folder's lm_head absent: tied; equal to the embedding: tied; different: refused naming it, on
every process), reads of touching byte ranges coalesced (counted), and refit.stream from the 2
processes (parameters over fsdp=8, so no process holds any whole matrix) giving every process the
tensors one process streams, bit for bit (the same launch: tests/hf_load_worker.py)."""
import json
import os

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import ROOT, argv, read_metrics  # noqa: E402
from hf_parity import hf_state  # noqa: E402
from MaxText.checkpoint_conversion import to_maxtext  # noqa: E402
from MaxText.config.load import replace  # noqa: E402
from MaxText.launch import local  # noqa: E402
from MaxText.models.model_config import ModelConfig  # noqa: E402
from MaxText.models.registry import get_hf_map, make_model_def  # noqa: E402
from MaxText.resolve import hf_sharded, safetensors_reads  # noqa: E402
from MaxText.sharding.mesh import create_mesh  # noqa: E402
from MaxText.sharding.rules import parse_rules, tree_shardings  # noqa: E402
from MaxText.train.loop import run  # noqa: E402

FAMILIES = ("qwen3_moe", "qwen3_moe_fused", "qwen3_next", "gemma4")
ARCH = ("emb_dim", "num_decoder_layers", "num_query_heads", "num_kv_heads", "head_dim", "mlp_dim",
        "vocab_size")


def _save(tensors, folder, config_from):
  from safetensors.numpy import save_file
  os.makedirs(folder, exist_ok=True)
  os.symlink(os.path.join(config_from, "config.json"), os.path.join(folder, "config.json"))
  save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
  from safetensors.numpy import load_file
  import test_gemma4_mm_audio
  import test_qwen3_moe_parity
  import test_qwen3_next_parity
  root = tmp_path_factory.mktemp("families")
  out = {name: str(root / name) for name in FAMILIES}
  moe = test_qwen3_moe_parity.hf_model("dense_first")       # layer 0 dense, 1-2 MoE
  moe.save_pretrained(out["qwen3_moe"])                      # the hub's per-expert files
  fused = hf_state(moe)
  assert any(k.endswith("mlp.experts.gate_up_proj") for k in fused)
  _save(fused, out["qwen3_moe_fused"], out["qwen3_moe"])
  nxt = test_qwen3_next_parity.hf_model("mixed")             # tied; linear/full, dense/MoE
  nxt.save_pretrained(out["qwen3_next"])
  single = os.path.join(out["qwen3_next"], "model.safetensors")
  tensors = {**load_file(single), **test_qwen3_next_parity.mtp_tensors("mixed")}
  os.remove(single)
  from safetensors.numpy import save_file
  save_file(tensors, single, metadata={"format": "pt"})
  from end_to_end.tiny_hf import save_tiny_tokenizer
  save_tiny_tokenizer(out["qwen3_next"])
  test_gemma4_mm_audio.hf_model().save_pretrained(out["gemma4"])   # vision + audio towers
  return out


def _leaves(tree):
  return {jax.tree_util.keystr(p): np.asarray(a)
          for p, a in jax.tree_util.tree_leaves_with_path(tree)}


def _bitwise_equal(got: dict, want: dict):
  assert sorted(got) == sorted(want)
  for k in want:
    assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
    assert got[k].tobytes() == want[k].tobytes(), k


def _load(folder, cfg, data, fsdp, tensor):
  cfg = replace(cfg, ici_data_parallelism=data, ici_fsdp_parallelism=fsdp,
                ici_tensor_parallelism=tensor)
  mcfg = ModelConfig.from_config(cfg)
  md = make_model_def(mcfg)
  sh = tree_shardings(md.logical_axes, md.abstract_params, create_mesh(cfg, jax.devices()),
                      parse_rules(cfg.logical_axis_rules, cfg.mesh_axes))
  abstract = jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h),
                          md.abstract_params, sh)
  got, stats = hf_sharded.load_sharded(folder, get_hf_map(cfg.hf_model_type), mcfg, abstract)
  assert jax.tree.map(lambda a: a.sharding, got) == sh
  return got, stats


@pytest.mark.parametrize("family", FAMILIES)
def test_one_process_load_is_the_converters_bits(folders, family):
  """Scanned over data=2, fsdp=2, tensor=2 and unscanned over fsdp=8: to_maxtext's bits."""
  folder = folders[family]
  for scan, mesh in (("true", (2, 2, 2)), ("false", (1, 8, 1))):
    cfg, ref = to_maxtext.load_hf(folder, [f"scan_layers={scan}"])
    got, stats = _load(folder, cfg, *mesh)
    _bitwise_equal(_leaves(got), _leaves(ref))
    assert stats.bytes <= sum(i.dtype.itemsize * int(np.prod(i.shape))
                              for i in safetensors_reads.SafetensorsFolder(folder).tensors.values())


def _tied_folder(src, dst, head=None):
  """A copy of tied Qwen3 folder `src` with `head` (or none) as lm_head.weight."""
  from safetensors.numpy import load_file
  tensors = load_file(os.path.join(src, "model.safetensors"))
  assert "lm_head.weight" not in tensors
  if head is not None:
    tensors["lm_head.weight"] = head(tensors["model.embed_tokens.weight"])
  _save(tensors, dst, src)
  for f in os.listdir(src):
    if f not in ("config.json", "model.safetensors"):
      os.symlink(os.path.join(src, f), os.path.join(dst, f))
  return str(dst)


def _nudged(emb):
  out = emb.copy()
  out[0, 0] = np.nextafter(out[0, 0], np.float32(np.inf))
  return out


@pytest.fixture(scope="module")
def tied_cases(tmp_path_factory):
  """A tiny tied Qwen3 folder's lm_head.weight absent, equal to the embedding, one ulp of one
  element off it, or of another shape."""
  from end_to_end.tiny_hf import save_tiny_tokenizer
  from test_conversion import tiny_qwen3
  root = tmp_path_factory.mktemp("tied")
  src = root / "tied"
  tiny_qwen3(src, tie=True)
  save_tiny_tokenizer(src)
  untied = root / "untied"          # refit's folder: lm_head a matrix of its own
  tiny_qwen3(untied)
  save_tiny_tokenizer(untied)
  return {"untied": str(untied), "absent": _tied_folder(src, root / "absent"),
          "equal": _tied_folder(src, root / "equal", lambda e: e.copy()),
          "differs": _tied_folder(src, root / "differs", _nudged),
          "shape": _tied_folder(src, root / "shape", lambda e: e[:-1].copy())}


@pytest.fixture(scope="module")
def two_processes(folders, tied_cases, tmp_path_factory):
  """One launch of tests/hf_load_worker.py on 2 processes x 4 devices for every test that needs
  one (each launch starts two Pythons and their jax): every family's folder, then the tied head
  that differs (refused on both processes) and the one that equals the embedding (loaded after
  the refusal: the processes agreed on it, none hangs), then refit's stream of an untied Qwen3.
  Its output folder."""
  out = tmp_path_factory.mktemp("two_processes")
  logs = out / "logs"
  result = local.launch([os.path.join(ROOT, "tests", "hf_load_worker.py"), str(out),
                         *(f"{n}={folders[n]}" for n in FAMILIES),
                         f"differs={tied_cases['differs']}", f"equal={tied_cases['equal']}",
                         f"refit={tied_cases['untied']}"], 2,
                        devices_per_process=4, log_dir=str(logs), cwd=ROOT, timeout_s=400)
  text = "".join((logs / f"process_{i}.{k}").read_text() for i in (0, 1) for k in ("out", "err"))
  assert [e.status for e in result.exits] == [0, 0], text[-4000:]
  return out


def test_two_processes_load_every_family_as_one_process_and_to_maxtext(folders, two_processes):
  """2 processes x 4 devices (fsdp=4, tensor=2): every parameter gathered whole equals a one-process
  load on the same mesh and to_maxtext's, bit for bit; each process read less than the folder and
  merged touching ranges into fewer reads."""
  tmp_path = two_processes
  for name in FAMILIES:
    folder = folders[name]
    cfg, ref = to_maxtext.load_hf(folder, [])
    one, _ = _load(folder, cfg, 1, 4, 2)
    with np.load(tmp_path / f"{name}.npz") as z:
      two = {k: z[k] for k in z.files}
    _bitwise_equal(two, _leaves(ref))
    _bitwise_equal(two, _leaves(one))
    total = sum(a.nbytes for a in jax.tree.leaves(ref))
    for i in (0, 1):
      stats = json.loads((tmp_path / f"{name}.{i}.json").read_text())
      assert stats["bytes"] < total, (name, i, stats, total)
      assert stats["reads"] < stats["ranges"], (name, i, stats)


def _run_args(out, name, *overrides):
  """conftest's argv without the architecture keys (they come from config.json)."""
  return [a for a in argv(out, name, *overrides) if a.split("=")[0] not in ARCH]


def test_train_from_a_qwen3_next_folder_as_from_its_conversion(folders, tmp_path):
  """train.py hf_path= on a family whose map is more than one NameMap (Qwen3-Next: conv weights
  laid out anew, the MTP layers counted from the tensor names): the first step's loss is that of
  the same step from to_maxtext's checkpoint."""
  folder = folders["qwen3_next"]
  steps = ("per_device_batch_size=1", "ici_data_parallelism=1", "ici_fsdp_parallelism=8",
           "ici_tensor_parallelism=1", "steps=1", "enable_checkpointing=false",
           "max_target_length=32")   # a shorter step to execute twice on 8 devices: the same claim
  code, _ = run(_run_args(tmp_path, "hf", *steps, f"hf_path={folder}"))
  assert code == 0
  ckpt = tmp_path / "ckpt"
  assert to_maxtext.main([f"hf_path={folder}", f"output_path={ckpt}"]) == 0
  code, _ = run(_run_args(tmp_path, "conv", *steps, f"load_parameters_path={ckpt}"))
  assert code == 0
  ours, theirs = read_metrics(tmp_path / "hf"), read_metrics(tmp_path / "conv")
  assert len(ours) == 1 and [r["loss"] for r in ours] == [r["loss"] for r in theirs]
  assert [r["batch_checksum"] for r in ours] == [r["batch_checksum"] for r in theirs]


def test_tied_embeddings_as_the_converter(tied_cases, two_processes, tmp_path, capsys):
  """tie_word_embeddings with the head absent or equal to the embedding: tied, to_maxtext's bits;
  a head that differs (one ulp of one element) or has another shape: refused naming it by both,
  by train.py before the first step (exit 4) and on both of 2 processes (which agree, none
  hangs: the `two_processes` launch)."""
  cases = tied_cases
  for name in ("absent", "equal"):
    cfg, ref = to_maxtext.load_hf(cases[name], [])
    assert cfg.tie_word_embeddings
    got, _ = _load(cases[name], cfg, 2, 2, 2)
    _bitwise_equal(_leaves(got), _leaves(ref))
  cfg, _ = to_maxtext.load_hf(cases["absent"], [])
  for name in ("differs", "shape"):
    with pytest.raises(ValueError, match="tie_word_embeddings=true but lm_head.weight differs"):
      to_maxtext.load_hf(cases[name], [])
    with pytest.raises(hf_sharded.HFFolderError,
                       match="tie_word_embeddings=true but lm_head.weight differs"):
      _load(cases[name], cfg, 2, 2, 2)
  code, _ = run(_run_args(tmp_path, "run", "per_device_batch_size=1", "steps=1",
                          "ici_fsdp_parallelism=8", "enable_checkpointing=false",
                          f"hf_path={cases['differs']}"))
  err = capsys.readouterr().err
  assert code == 4 and "lm_head.weight differs from the embedding" in err, err
  assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")
  for i in (0, 1):
    verdict = json.loads((two_processes / f"differs.{i}.json").read_text())
    assert "lm_head.weight differs from the embedding" in verdict.get("error", ""), verdict
  with np.load(two_processes / "equal.npz") as z:
    _bitwise_equal({k: z[k] for k in z.files}, _leaves(to_maxtext.load_hf(cases["equal"], [])[1]))


def test_touching_ranges_are_one_read(folders, monkeypatch):
  """Every byte range a load reads, recorded: no two touch or overlap (they would have been one
  read), and one process holding the whole model reads each shard file's tensors in one read."""
  spans = []
  real = safetensors_reads._fetch

  def recording(path, s):
    spans.extend((path, a, b) for a, b in s)
    return real(path, s)
  monkeypatch.setattr(safetensors_reads, "_fetch", recording)
  folder = folders["qwen3_moe"]
  cfg, _ = to_maxtext.load_hf(folder, [])
  _, stats = _load(folder, cfg, 1, 8, 1)
  st = safetensors_reads.SafetensorsFolder(folder)
  files = sorted({i.file for i in st.tensors.values()})
  assert stats.reads == len(spans) == len(files) < stats.ranges
  for f in files:
    begin = min(i.start for i in st.tensors.values() if i.file == f)
    assert [(a, b) for p, a, b in spans if p == f] == [(begin, os.path.getsize(f))]
  spans.clear()
  _, stats = _load(folder, cfg, 2, 2, 2)
  assert stats.reads == len(spans) < stats.ranges
  spans.sort()
  for (p, _, b), (q, a, _) in zip(spans, spans[1:]):
    assert p != q or a > b


def test_refit_stream_from_two_processes_yields_one_processs_tensors(tied_cases, two_processes):
  """refit.stream on 2 processes x 4 devices (parameters over fsdp=8, so no process holds any
  whole matrix): every process receives every Hugging Face tensor, bit for bit what one process
  streaming the same parameters receives."""
  from MaxText import refit
  cfg, ref = to_maxtext.load_hf(tied_cases["untied"], [])
  one = dict(refit.stream(ref, cfg, layout="checkpoint"))
  for i in (0, 1):
    with np.load(two_processes / f"refit.process_{i}.npz") as got:
      assert sorted(got.files) == sorted(one)
      for name, t in one.items():
        assert got[name].dtype == t.dtype and got[name].tobytes() == t.tobytes(), name
