"""Hugging Face ⇄ our checkpoints: convert a tiny random Qwen3, fine-tune it (architecture taken
from the checkpoint), export it back, and check transformers reproduces our logits."""
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import BASE_YML, MESH_1, ROOT, argv, train  # noqa: E402
from MaxText.checkpoint.manager import load_params_host  # noqa: E402
from MaxText.checkpoint_conversion import to_huggingface, to_maxtext  # noqa: E402
from MaxText.checkpoint_conversion.to_huggingface import checkpoint_config  # noqa: E402
from MaxText.models.model_config import ModelConfig  # noqa: E402
from MaxText.models.registry import make_model_def  # noqa: E402


def tiny_qwen3(folder, tie=False):
  torch.manual_seed(0)
  config = transformers.Qwen3Config(
      vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
      rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=tie)
  model = transformers.Qwen3ForCausalLM(config).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.add_(0.1 * torch.randn_like(p))
  model.save_pretrained(folder)
  return model


def our_logits(ckpt, tokens):
  cfg = checkpoint_config(ckpt)
  md = make_model_def(ModelConfig.from_config(cfg))
  params = load_params_host(ckpt, md.abstract_params)
  B, S = tokens.shape
  pos = np.broadcast_to(np.arange(S, dtype=np.int32), (B, S))
  return np.asarray(md.apply(params, tokens, pos, np.ones((B, S), np.int32)))


def test_convert_finetune_export_round_trip(tmp_path):
  hf_dir, ckpt, out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "export"
  model = tiny_qwen3(hf_dir)
  assert to_maxtext.main([f"hf_path={hf_dir}", f"output_path={ckpt}"]) == 0
  tokens = np.random.default_rng(0).integers(0, 384, (2, 24)).astype(np.int32)
  with torch.no_grad():
    ref = model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
  ours = our_logits(str(ckpt), tokens)
  assert np.max(np.abs(ours - ref)) <= 1e-4 * np.max(np.abs(ref))

  # fine-tune: the architecture (emb 64, 2 layers, vocab 384, qk-norm, θ 1e6) comes from the
  # checkpoint although conftest's TINY says otherwise for some keys… so don't pass those here
  run_args = [a for a in argv(tmp_path, "ft", *MESH_1, "steps=2", "enable_checkpointing=true")
              if a.split("=")[0] not in ("emb_dim", "num_decoder_layers", "num_query_heads",
                                         "num_kv_heads", "head_dim", "mlp_dim", "vocab_size")]
  from MaxText.train.loop import run
  code, trainer = run([*run_args, f"load_parameters_path={ckpt}"], devices=jax.devices()[:1])
  assert code == 0
  assert trainer.cfg.emb_dim == 64 and trainer.cfg.hf_model_type == "qwen3"
  assert trainer.cfg.rope_theta == 1e6 and trainer.cfg.use_qk_norm

  # export the fine-tuned run and load it with transformers, unchanged
  run_ckpt = tmp_path / "ft" / "checkpoints"
  assert to_huggingface.main([f"load_parameters_path={run_ckpt}", f"output_path={out}"]) == 0
  assert "model.safetensors" in os.listdir(out)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  with torch.no_grad():
    theirs = reloaded(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
  ours = our_logits(str(run_ckpt), tokens)
  assert np.max(np.abs(ours - theirs)) <= 1e-4 * np.max(np.abs(theirs))
  assert np.max(np.abs(theirs - ref)) > 1e-6  # it really was fine-tuned


def test_explicit_architecture_that_disagrees_is_refused(tmp_path):
  tiny_qwen3(tmp_path / "hf")
  assert to_maxtext.main([f"hf_path={tmp_path / 'hf'}", f"output_path={tmp_path / 'ckpt'}"]) == 0
  p = subprocess.run([sys.executable, "train.py", BASE_YML, "emb_dim=128",
                      f"load_parameters_path={tmp_path / 'ckpt'}"], cwd=ROOT, capture_output=True,
                     text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=120)
  assert p.returncode == 2
  assert "emb_dim=128 disagrees with the checkpoint" in p.stderr and "emb_dim=64" in p.stderr


def test_bad_hf_folders_leave_no_output(tmp_path):
  hf = tmp_path / "hf"
  tiny_qwen3(hf)
  config = json.loads((hf / "config.json").read_text())
  (hf / "config.json").write_text(json.dumps({**config, "model_type": "mystery"}))
  assert to_maxtext.main([f"hf_path={hf}", f"output_path={tmp_path / 'a'}"]) == 2
  assert not (tmp_path / "a").exists()
  (hf / "config.json").write_text(json.dumps({**config, "hidden_size": 96}))
  assert to_maxtext.main([f"hf_path={hf}", f"output_path={tmp_path / 'b'}"]) == 2
  assert not (tmp_path / "b").exists() or not any((tmp_path / "b").iterdir())


def test_logit_check_passes_and_fails_honestly(tmp_path, capsys):
  from MaxText import logit_check
  tiny_qwen3(tmp_path / "hf", tie=True)
  assert to_maxtext.main([f"hf_path={tmp_path / 'hf'}", f"output_path={tmp_path / 'ckpt'}"]) == 0
  base = [f"hf_path={tmp_path / 'hf'}", f"load_parameters_path={tmp_path / 'ckpt'}"]
  assert logit_check.main(base) == 0
  out = capsys.readouterr().out
  last = out.strip().splitlines()[-1]
  assert last.startswith("max_kl=") and " max_abs_diff=" in last
  assert "long    tokens= 512" in out and "packed" in out
  # an impossible threshold must fail
  assert logit_check.main(base + ["max_kl=0", "atol_fraction=0"]) == 1
  assert "FAIL" in capsys.readouterr().out
  # bf16 on both sides: KL within MaxText's 0.015 bound (measured ~4e-5 on a 4-layer model)
  assert logit_check.main(base + ["dtype=bfloat16"]) == 0
  out = capsys.readouterr().out
  assert "PASS" in out and float(out.strip().splitlines()[-1].split()[0].split("=")[1]) > 0
