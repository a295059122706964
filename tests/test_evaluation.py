"""Held-out evaluation: the eval_split_fraction split never overlaps what training reads (file
documents with unique markers, and the embedded default's documents); evaluation during training
logs eval_loss / eval_perplexity at eval_period and the last step (stdout, metrics.jsonl,
TensorBoard); `python -m MaxText.evaluate` on a converted checkpoint (with its own tokenizer) gives
the mean token loss of transformers' forward on the same batches; bad eval keys exit 2."""
import glob
import json
import math
import os

import jax
import numpy as np
import pytest

from conftest import BASE_YML, MESH_1, train
from MaxText import evaluate
from MaxText.config.load import load_config
from MaxText.data import sources
from MaxText.data.config import DataConfig
from MaxText.data.eval_data import EvalBatches, eval_source
from MaxText.data.pipeline import make_shard_iterator
from MaxText.data.tokenizers import ByteTokenizer, make_tokenizer

DOCS = 40


def marked_docs(folder) -> str:
  """A jsonl of DOCS documents, each its marker "<k>" repeated (k = 1000 + index)."""
  path = os.path.join(folder, "docs.jsonl")
  with open(path, "w", encoding="utf-8") as f:
    for i in range(DOCS):
      f.write(json.dumps({"text": f"<{1000 + i}> " * (3 + i % 5)}) + "\n")
  return path


def markers(rows: np.ndarray) -> set[int]:
  text = ByteTokenizer().decode(rows.reshape(-1).tolist())
  return {int(t[1:5]) - 1000 for t in text.split() if len(t) == 6 and t[0] == "<"}


def test_held_out_split_never_overlaps_training(tmp_path):
  path = marked_docs(tmp_path)
  cfg = load_config([BASE_YML, "dataset_type=file", f"dataset_path={path}", "eval_split_fraction=0.1",
                     "max_target_length=32"])
  dcfg = DataConfig.from_config(cfg)
  held = [i for i, h in enumerate(sources.held_out(DOCS, 0.1)) if h]
  assert held == [9, 19, 29, 39]
  # every batch of two epochs of training, over 2 data shards
  it = make_shard_iterator(dcfg, [0, 1], 2, 4)
  seen = set()
  for _ in range(30):
    seen |= markers(next(it)["inputs"])
  assert seen == set(range(DOCS)) - set(held)
  ev = EvalBatches(*eval_source(dcfg, ""), ByteTokenizer(), [0, 1], 2, 4, steps=10)
  assert set().union(*(markers(b["inputs"]) for b in ev)) == set(held)
  # the embedded default: the held-out documents are the training source's complement
  embedded = sources.embedded_source()
  train_docs = sources.split_source(embedded, 0.05, "train")
  eval_docs = sources.split_source(embedded, 0.05, "eval")
  assert not set(train_docs.indices) & set(eval_docs.indices)
  assert len(train_docs) + len(eval_docs) == len(embedded) and len(eval_docs) > 10


def test_eval_during_training_logs_everywhere(tmp_path, capsys):
  code, rows, _ = train(tmp_path, "ev", *MESH_1, "steps=6", "eval_period=4", "eval_steps=2",
                        "eval_split_fraction=0.05", "enable_checkpointing=false",
                        "enable_tensorboard=true", devices=jax.devices()[:1])
  assert code == 0
  evals = [r for r in rows if "eval_loss" in r]
  assert [r["step"] for r in evals] == [4, 6]
  for r in evals:
    assert 0 < r["eval_loss"] < 10 and math.isclose(r["eval_perplexity"], math.exp(r["eval_loss"]))
    assert r["eval_tokens"] > 0
  assert evals[1]["eval_tokens"] == evals[0]["eval_tokens"]     # the same held-out batches
  out = capsys.readouterr().out
  assert "eval after step 4 | eval_loss" in out and "eval after step 6 | eval_loss" in out
  from test_metrics import _read_tensorboard_scalars
  [events] = glob.glob(str(tmp_path / "ev" / "tensorboard" / "events.*"))
  scalars = _read_tensorboard_scalars(events)
  assert sorted(step for tag, step in scalars if tag == "eval_loss") == [4, 6]
  assert math.isclose(scalars[("eval_loss", 6)], evals[1]["eval_loss"], rel_tol=1e-6)


@pytest.mark.parametrize("args,key", [
    (("eval_period=2",), "eval_split_fraction"),                               # no held-out data
    (("eval_period=2", "eval_dataset_path=/no/such.jsonl"), "eval_dataset_path"),
    (("eval_period=2", "eval_split_fraction=0.1", "dataset_type=synthetic"), "eval_split_fraction"),
])
def test_bad_eval_keys_exit_2(tmp_path, capsys, args, key):
  code, _, _ = train(tmp_path, "bad", *MESH_1, *args, devices=jax.devices()[:1])
  assert code == 2 and key in capsys.readouterr().err


def test_evaluate_a_checkpoint_equals_transformers_mean_loss(tmp_path, capsys):
  torch = pytest.importorskip("torch")
  from hf_parity import build_hf_model
  from test_qwen3_parity import our_config
  import transformers
  from end_to_end.tiny_hf import save_tiny_tokenizer
  from MaxText.checkpoint import tokenizer_files
  from MaxText.checkpoint.manager import resolve_step_dir
  from MaxText.checkpoint_conversion import to_maxtext
  from MaxText.models.llama import qwen3_hf_map as hf_map
  hf = build_hf_model(transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
                      hf_map.config_to_hf(our_config(False, True)))
  hf.save_pretrained(tmp_path / "hf")
  save_tiny_tokenizer(str(tmp_path / "hf"))     # travels into the checkpoint; evaluate uses it
  assert to_maxtext.main([f"hf_path={tmp_path / 'hf'}", f"output_path={tmp_path / 'ckpt'}"]) == 0
  data = marked_docs(tmp_path)
  args = [BASE_YML, f"load_parameters_path={tmp_path / 'ckpt'}", "dataset_type=file",
          f"dataset_path={data}", "max_target_length=48", "per_device_batch_size=0.5",
          "eval_steps=3", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=4"]
  assert evaluate.main(args) == 0
  out = capsys.readouterr().out
  assert "the checkpoint's own, from load_parameters_path" in out
  last = out.strip().splitlines()[-1]
  got = dict(kv.split("=") for kv in last.split())
  assert list(got) == ["eval_loss", "eval_perplexity", "tokens"]
  # the reference: transformers on each document piece of the same batches (all of the file)
  cfg = load_config(args)
  carried = tokenizer_files.in_checkpoint(resolve_step_dir(str(tmp_path / "ckpt")))
  tokenizer = make_tokenizer("auto", carried)
  batches = EvalBatches(DataConfig.from_config(cfg), "all", tokenizer, [0], 1, 4, 3)
  nll, tokens = 0.0, 0
  for b in batches:
    for row in range(4):
      for seg in set(b["inputs_segmentation"][row].tolist()) - {0}:
        at = b["inputs_segmentation"][row] == seg
        with torch.no_grad():
          logits = hf(torch.tensor(b["inputs"][row, at][None], dtype=torch.long)).logits[0]
        nll += torch.nn.functional.cross_entropy(
            logits.double(), torch.tensor(b["targets"][row, at], dtype=torch.long),
            reduction="sum").item()
        tokens += int(at.sum())
  assert int(got["tokens"]) == tokens > 0
  assert abs(float(got["eval_loss"]) - nll / tokens) < 1e-5 * (nll / tokens)
  assert math.isclose(float(got["eval_perplexity"]), math.exp(nll / tokens), rel_tol=1e-4)
  # without parameters: exit 2, no traceback
  assert evaluate.main([BASE_YML, "eval_steps=1"]) == 2
  assert "load_parameters_path or hf_path" in capsys.readouterr().err
