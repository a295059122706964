"""Hugging Face ⇄ our checkpoints: convert a tiny random Qwen3, fine-tune it (architecture taken
from the checkpoint), export it back, and check transformers reproduces our logits."""
import json
import os

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import BASE_YML, MESH_1, argv  # noqa: E402
from end_to_end.tiny_hf import save_tiny_tokenizer  # noqa: E402
from MaxText.checkpoint.manager import load_params_host  # noqa: E402
from MaxText.checkpoint_conversion import to_huggingface, to_maxtext  # noqa: E402
from MaxText.runtime.exit_codes import EXIT_CHECK_FAILED  # noqa: E402
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


def finetune_args(out, name):
  """Fine-tune args: the architecture (emb 64, 2 layers, vocab 384, qk-norm, θ 1e6) comes from the
  checkpoint although conftest's TINY says otherwise for some keys… so those are not passed."""
  return [a for a in argv(out, name, *MESH_1, "steps=2", "enable_checkpointing=true")
          if a.split("=")[0] not in ("emb_dim", "num_decoder_layers", "num_query_heads",
                                     "num_kv_heads", "head_dim", "mlp_dim", "vocab_size")]


def test_convert_finetune_export_round_trip(tmp_path, capsys):
  hf_dir, ckpt, out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "export"
  model = tiny_qwen3(hf_dir)
  hf_tok = save_tiny_tokenizer(hf_dir)       # the tokenizer travels with the model
  assert to_maxtext.main([f"hf_path={hf_dir}", f"output_path={ckpt}"]) == 0
  assert set(os.listdir(ckpt / "0" / "tokenizer")) - {"commit_success.txt"} == {
      "chat_template.jinja", "tokenizer.json", "tokenizer_config.json"}
  tokens = np.random.default_rng(0).integers(0, 384, (2, 24)).astype(np.int32)
  with torch.no_grad():
    ref = model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
  ours = our_logits(str(ckpt), tokens)
  assert np.max(np.abs(ours - ref)) <= 1e-4 * np.max(np.abs(ref))

  run_args = finetune_args(tmp_path, "ft")
  from MaxText.train.loop import run
  # a byte tokenizer on this model's vocabulary is refused before anything compiles
  code, _ = run([*run_args, f"load_parameters_path={ckpt}", "tokenizer_type=byte"],
                devices=jax.devices()[:1])
  assert code == 2 and "byte ids would mean nothing to it" in capsys.readouterr().err
  code, trainer = run([*run_args, f"load_parameters_path={ckpt}"], devices=jax.devices()[:1])
  assert code == 0
  assert trainer.cfg.emb_dim == 64 and trainer.cfg.hf_model_type == "qwen3"
  assert trainer.cfg.rope_theta == 1e6 and trainer.cfg.use_qk_norm
  # by default the run uses the checkpoint's tokenizer, says so, and saves it in its checkpoints
  ckpt_tok = ckpt / "0" / "tokenizer" / "tokenizer.json"
  assert (trainer.cfg.tokenizer_type, trainer.cfg.tokenizer_path) == ("huggingface", str(ckpt_tok))
  assert f"tokenizer: huggingface {ckpt_tok} (" in capsys.readouterr().out
  assert "tokenizer" in os.listdir(tmp_path / "ft" / "checkpoints" / "2")

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
  # the export carries the tokenizer: transformers loads it, with its special tokens and chat
  # template, and it encodes as the original
  exported = transformers.AutoTokenizer.from_pretrained(out)
  text = "the quick brown fox, and a zebra"
  assert exported.encode(text) == hf_tok.encode(text)
  assert (exported.bos_token, exported.eos_token, exported.pad_token) == ("<|bos|>", "<|eos|>",
                                                                          "<pad>")
  chat = [{"role": "user", "content": "hi"}]
  assert exported.apply_chat_template(chat, tokenize=False) == \
      hf_tok.apply_chat_template(chat, tokenize=False) == "<|bos|>user: hi<|eos|>"


def test_checkpoint_of_a_real_vocabulary_without_tokenizer_files_needs_tokenizer_path(tmp_path,
                                                                                      capsys):
  """An HF folder without tokenizer files: the converter says so, and a fine-tune from it refuses
  to fall back to bytes (exit 2 naming tokenizer_path) instead of training on meaningless ids."""
  from MaxText.train.loop import run
  tiny_qwen3(tmp_path / "hf")
  assert to_maxtext.main([f"hf_path={tmp_path / 'hf'}", f"output_path={tmp_path / 'ckpt'}"]) == 0
  assert "tokenizer files: none in hf_path" in capsys.readouterr().out
  code, _ = run([*finetune_args(tmp_path, "ft"), f"load_parameters_path={tmp_path / 'ckpt'}"],
                devices=jax.devices()[:1])
  err = capsys.readouterr().err
  assert code == 2 and "has the vocabulary of a real tokenizer but its huggingface tokenizer " \
      "files are not in the checkpoint; set tokenizer_path to it" in err


def test_explicit_architecture_that_disagrees_is_refused(tmp_path, capsys):
  """In this process (the exit status train.py passes on is run()'s: tests/test_config.py runs
  train.py's refusals as processes)."""
  from MaxText.train.loop import run
  tiny_qwen3(tmp_path / "hf")
  assert to_maxtext.main([f"hf_path={tmp_path / 'hf'}", f"output_path={tmp_path / 'ckpt'}"]) == 0
  capsys.readouterr()
  code, _ = run([BASE_YML, "emb_dim=128", f"load_parameters_path={tmp_path / 'ckpt'}"],
                devices=jax.devices()[:1])
  err = capsys.readouterr().err
  assert code == 2
  assert "emb_dim=128 disagrees with the checkpoint" in err and "emb_dim=64" in err


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
  assert logit_check.main(base + ["max_kl=0", "atol_fraction=0"]) == EXIT_CHECK_FAILED
  assert "FAIL" in capsys.readouterr().out
  # bf16 on both sides: KL within MaxText's 0.015 bound (measured ~4e-5 on a 4-layer model)
  assert logit_check.main(base + ["dtype=bfloat16"]) == 0
  out = capsys.readouterr().out
  assert "PASS" in out and float(out.strip().splitlines()[-1].split()[0].split("=")[1]) > 0


def test_checkpoint_config_computes_in_the_tools_dtype(monkeypatch):
  # a default training run stores its bf16 compute dtype; a tool reading the checkpoint's config
  # (to_huggingface, refit, the parity scripts' forward) must compute in float32, where the
  # Hugging Face parity is exact, and keep every other stored key
  monkeypatch.setattr(to_huggingface, "read_meta",
                      lambda path: {"config": {"dtype": "bfloat16", "emb_dim": 96}})
  cfg = checkpoint_config("/some/ckpt")
  assert cfg.dtype == "float32"
  assert cfg.emb_dim == 96


def test_a_byte_level_models_export_carries_a_tokenizer_transformers_loads(tmp_path):
  """A model trained on the byte tokenizer (no tokenizer files in its checkpoint): the export
  writes the byte tokenizer as a `tokenizers` tokenizer.json; transformers' AutoTokenizer (the
  oracle) encodes every text to our ids (with the bos training's add_bos puts first) and decodes
  them back, special tokens named as ours."""
  from MaxText.checkpoint.manager import save_params_only
  from MaxText.config.load import load_config
  from MaxText.data.tokenizers import ByteTokenizer
  from MaxText.models.registry import init_params
  cfg = load_config([BASE_YML, "emb_dim=16", "num_decoder_layers=1", "num_query_heads=2",
                     "num_kv_heads=1", "head_dim=8", "mlp_dim=32", "vocab_size=264"])
  ckpt, out = str(tmp_path / "ckpt"), tmp_path / "export"
  save_params_only(ckpt, jax.device_get(init_params(ModelConfig.from_config(cfg), 0)),
                   cfg.as_dict())
  assert to_huggingface.main([f"load_parameters_path={ckpt}", f"output_path={out}"]) == 0
  exported = transformers.AutoTokenizer.from_pretrained(out)
  ours = ByteTokenizer()
  for text in ["def main():\n\treturn 0", " é 日本 😀\x00\r\n  ", ""]:
    ids = exported(text)["input_ids"]
    assert ids == [ours.bos_id, *ours.encode(text)], text
    assert exported.decode(ids, skip_special_tokens=True) == text == ours.decode(ids)
  assert (exported.pad_token_id, exported.bos_token_id, exported.eos_token_id) == (0, 1, 2)
  assert exported.convert_ids_to_tokens([0, 1, 2]) == list(ByteTokenizer.SPECIAL_TOKENS)
  assert len(exported) == ours.vocab_size
  with open(out / "config.json", encoding="utf-8") as f:
    config = json.load(f)
  assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 0)
