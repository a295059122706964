"""to_huggingface as transformers and peft use the export: `config.json` and `generation_config.json`
carry the tokenizer's eos (and pad), so transformers' `generate` on the export stops at
`<|im_end|>`; a PEFT export names the Hugging Face folder its base was converted from, so
`peft.AutoPeftModelForCausalLM.from_pretrained(OUT)` loads base + adapter and reproduces our
forward of the LoRA checkpoint."""
import json

import jax
import numpy as np
import pytest

import sft_helpers as h
from conftest import BASE_YML, CACHE_DIR
from MaxText.checkpoint_conversion import to_huggingface, to_maxtext
from MaxText.checkpoint_conversion.to_huggingface import checkpoint_config
from MaxText.models.model_config import ModelConfig
from MaxText.models.registry import make_model_def
from MaxText.resolve import lora_base
from MaxText.train.loop import run

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
CHAT = [{"role": "user", "content": "hello how are"}]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  """(root, prompt ids, eos id): hf/ a tiny Qwen3 whose head makes <|im_end|> its first greedy
  answer to the prompt (its row: 3x the row of the token it would pick, whose logit is > 0), with
  no eos in its own config; ckpt/ its conversion."""
  root = tmp_path_factory.mktemp("export")
  tok = h.save_qwen3_chat(root / "hf")
  eos = tok.convert_tokens_to_ids("<|im_end|>")
  prompt = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True,
                                   return_dict=True)["input_ids"]
  model = transformers.AutoModelForCausalLM.from_pretrained(root / "hf").eval()
  with torch.no_grad():
    logits = model(torch.tensor([prompt])).logits[0, -1]
    first = int(logits.argmax())
    assert first != eos and float(logits[first]) > 0
    model.lm_head.weight[eos] = 3 * model.lm_head.weight[first]
  model.config.eos_token_id = model.generation_config.eos_token_id = None
  model.save_pretrained(root / "hf")
  assert json.loads((root / "hf" / "config.json").read_text()).get("eos_token_id") is None
  assert to_maxtext.main([f"hf_path={root / 'hf'}", f"output_path={root / 'ckpt'}"]) == 0
  return root, prompt, eos


def greedy(folder, prompt, n=6):
  model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
  with torch.no_grad():
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
  return out[0, len(prompt):].tolist()


def test_generate_on_the_export_stops_at_eos(converted, tmp_path):
  root, prompt, eos = converted
  assert len(greedy(root / "hf", prompt)) == 6    # the source names no eos: generate runs on
  assert to_huggingface.main([f"load_parameters_path={root / 'ckpt'}",
                              f"output_path={tmp_path / 'out'}"]) == 0
  config = json.loads((tmp_path / "out" / "config.json").read_text())
  pad = transformers.AutoTokenizer.from_pretrained(root / "hf").pad_token_id
  assert config["eos_token_id"] == eos and config["pad_token_id"] == pad
  assert "bos_token_id" not in config   # the tokenizer has none (as Qwen3)
  generation = transformers.GenerationConfig.from_pretrained(tmp_path / "out")
  assert generation.eos_token_id == eos and generation.pad_token_id == pad
  assert greedy(tmp_path / "out", prompt) == [eos]   # stops at <|im_end|>


def ours(ckpt, tokens):
  mcfg = ModelConfig.from_config(checkpoint_config(ckpt))
  md = make_model_def(mcfg)
  params = lora_base.load_host(ckpt, mcfg, md.abstract_params)   # the adapters + their base
  pos = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
  return np.asarray(md.apply(params, tokens, pos, np.ones(tokens.shape, np.int32)))


def test_auto_peft_model_loads_the_adapter_export(converted, tmp_path):
  root, prompt, _ = converted
  code, _ = run([BASE_YML, f"load_parameters_path={root / 'ckpt'}", "dataset_type=synthetic",
                 "lora_rank=4", "lora_alpha=8", "learning_rate=1e-2", "warmup_steps=0", "steps=2",
                 "per_device_batch_size=2", "max_target_length=32", "dtype=float32",
                 f"base_output_directory={tmp_path}", "run_name=lora", "sample_at_end=false",
                 "enable_tensorboard=false", "peak_tflops_per_device=1.0",
                 f"jax_cache_dir={CACHE_DIR}", "ici_fsdp_parallelism=1"],
                devices=jax.devices()[:1])
  assert code == 0
  ckpt, out = tmp_path / "lora" / "checkpoints", tmp_path / "peft"
  assert to_huggingface.main([f"load_parameters_path={ckpt}", f"output_path={out}",
                              "adapter_format=peft"]) == 0
  adapter = json.loads((out / "adapter_config.json").read_text())
  assert adapter["base_model_name_or_path"] == str(root / "hf")
  peft = pytest.importorskip("peft")   # here, not at collection: peft imports ~2 s of transformers
  model = peft.AutoPeftModelForCausalLM.from_pretrained(str(out)).eval()
  tokens = np.asarray([prompt], np.int32)
  with torch.no_grad():
    got = model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()
  want = ours(str(ckpt), tokens)
  # fp32 forwards of the same weights by two implementations (the bound of tests/test_lora_export)
  assert np.max(np.abs(got - want)) <= 1e-4 * max(1.0, float(np.max(np.abs(want))))
  base = transformers.AutoModelForCausalLM.from_pretrained(root / "hf").eval()
  with torch.no_grad():
    plain = base(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()
  assert np.max(np.abs(plain - want)) > 1e-3   # the adapters were trained: they are in `got`
