"""The README's SFT recipe as written, on a tiny Qwen3 built here (no bos token, as every Qwen3; a
ChatML template without {% generation %} blocks, eos <|im_end|>) converted by to_maxtext: with the
default `sample_at_end=true` it exits 0, saves its last step and prints a sample whose prompt is a
chat record rendered up to the assistant turn; a sample that fails after the last step is logged
and costs neither the exit status nor the checkpoint. `add_bos=true` (the default) is no refusal
in SFT, where the chat template writes the special tokens, and stays one for plain text; a
converted checkpoint without tokenizer files fine-tunes on synthetic data, which never tokenizes.
"""
import os

import jax
import pytest

import sft_helpers as h
from conftest import CACHE_DIR, ROOT
from MaxText.checkpoint_conversion import to_maxtext
from MaxText.config.load import load_config
from MaxText.data.config import DataConfig
from MaxText.data.errors import DataError
from MaxText.data.validation import validate_data_config
from MaxText.train import samples
from MaxText.train.loop import run

pytest.importorskip("transformers")
SFT_YML = os.path.join(ROOT, "configs", "sft.yml")


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
  """A folder with hf/ (the tiny Qwen3), ckpt/ (to_maxtext of it) and chats.jsonl."""
  root = tmp_path_factory.mktemp("recipe")
  h.save_qwen3_chat(root / "hf")
  assert to_maxtext.main([f"hf_path={root / 'hf'}", f"output_path={root / 'ckpt'}"]) == 0
  h.write_jsonl(root / "chats.jsonl", h.conversations(64))
  return root


def readme_sft(root, run_name: str) -> list[str]:
  """The README's command (configs/sft.yml … lora_rank=16 lora_alpha=32 run_name=…), then where it
  writes and a short run on this machine (the sample keys keep their defaults)."""
  return [SFT_YML, f"load_parameters_path={root / 'ckpt'}",
          f"dataset_path={root / 'chats.jsonl'}", f"tokenizer_path={root / 'hf' / 'tokenizer.json'}",
          "lora_rank=16", "lora_alpha=32", f"run_name={run_name}",
          f"base_output_directory={root / 'runs'}", "steps=3", "per_device_batch_size=2",
          "max_target_length=128", "max_new_tokens=8", "enable_tensorboard=false",
          "peak_tflops_per_device=1.0", f"jax_cache_dir={CACHE_DIR}", "ici_fsdp_parallelism=1"]


def test_readme_sft_recipe_saves_and_samples_a_chat_prompt(recipe, capsys):
  argv = readme_sft(recipe, "sft")
  cfg = load_config(argv)
  assert cfg.sample_at_end and cfg.add_bos and cfg.sft   # the defaults the recipe runs with
  code, _ = run(argv, devices=jax.devices()[:1])
  out, err = capsys.readouterr()
  assert code == 0, err[-3000:]
  assert os.path.isdir(recipe / "runs" / "sft" / "checkpoints" / "3"), err[-3000:]
  assert "sample after step 3" in out, out[-3000:]
  assert ("prompt (the first training conversation (" in out
          and "up to its last assistant message, by the chat template)" in out), out[-3000:]
  first = h.conversations(1)[0]["messages"]   # system "be brief", a user question, the answer
  prompt = out[out.index("sample after step 3"):out.index("continued by the model")]
  assert first[0]["content"] in prompt and first[1]["content"] in prompt
  assert first[2]["content"] not in prompt   # the assistant's answer is what the model writes
  assert "failed and was skipped" not in err


def test_failed_sample_keeps_the_checkpoint_and_exit_0(recipe, capsys, monkeypatch):
  def fail(self, params):
    raise RuntimeError("forced sample failure")
  monkeypatch.setattr(samples.Sampler, "generate", fail)
  code, _ = run(readme_sft(recipe, "sft_failing_sample"), devices=jax.devices()[:1])
  out, err = capsys.readouterr()
  assert code == 0, err[-3000:]
  assert os.path.isdir(recipe / "runs" / "sft_failing_sample" / "checkpoints" / "3")
  assert ("warning: the sample after step 3 failed and was skipped (RuntimeError: forced sample "
          "failure)") in err
  assert "latest step 3" in out


def test_add_bos_refused_only_for_plain_text(recipe, tmp_path):
  text = tmp_path / "plain.txt"
  text.write_text("hello how are you\n")
  plain = load_config([os.path.join(ROOT, "configs", "base.yml"), "dataset_type=file",
                       f"dataset_path={text}", f"tokenizer_path={recipe / 'hf' / 'tokenizer.json'}",
                       "vocab_size=320"])
  with pytest.raises(DataError, match="add_bos=true but the tokenizer .* has no bos_token"):
    validate_data_config(DataConfig.from_config(plain))
  chat = load_config([SFT_YML, f"dataset_path={recipe / 'chats.jsonl'}", "vocab_size=320",
                      f"tokenizer_path={recipe / 'hf' / 'tokenizer.json'}"])
  assert chat.add_bos and chat.add_eos
  assert validate_data_config(DataConfig.from_config(chat)).bos_id is None


def test_synthetic_fine_tune_of_a_checkpoint_without_tokenizer_files(tmp_path, capsys):
  hf = tmp_path / "hf"
  h.save_qwen3_chat(hf)
  for name in os.listdir(hf):   # a model folder without tokenizer files
    if name.startswith(("tokenizer", "chat_template")):
      os.remove(hf / name)
  assert to_maxtext.main([f"hf_path={hf}", f"output_path={tmp_path / 'ckpt'}"]) == 0
  common = [os.path.join(ROOT, "configs", "base.yml"),
            f"base_output_directory={tmp_path / 'runs'}", "steps=2", "per_device_batch_size=2",
            "max_target_length=32", "enable_tensorboard=false", "peak_tflops_per_device=1.0",
            f"jax_cache_dir={CACHE_DIR}", "ici_fsdp_parallelism=1", "max_new_tokens=4"]
  ckpt = f"load_parameters_path={tmp_path / 'ckpt'}"
  code, _ = run([*common, ckpt, "dataset_type=synthetic", "run_name=syn"], devices=jax.devices()[:1])
  out, err = capsys.readouterr()
  assert code == 0, err[-3000:]
  assert "dataset_type=synthetic never tokenizes" in out
  assert "sample after step 2: none (the run has no tokenizer" in out
  assert os.path.isdir(tmp_path / "runs" / "syn" / "checkpoints" / "2")
  # where text is tokenized the refusal stands, naming the key
  code, _ = run([*common, ckpt, "run_name=text"], devices=jax.devices()[:1])
  assert code == 2 and "tokenizer_path: the model at load_parameters_path=" in capsys.readouterr().err
  # and a fine-tune of the synthetic run's checkpoint still knows its vocabulary is a real one's
  code, _ = run([*common, f"load_parameters_path={tmp_path / 'runs' / 'syn' / 'checkpoints'}",
                 "run_name=text2"], devices=jax.devices()[:1])
  assert code == 2 and "tokenizer_path: the model at load_parameters_path=" in capsys.readouterr().err
