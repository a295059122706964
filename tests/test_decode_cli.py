"""`python -m MaxText.decode` and `MaxText.inference`: a tokenizer's chat template renders as
transformers' apply_chat_template; a Hugging Face folder decoded in memory with chat=true gives
transformers' greedy tokens (eos included) and a decode_output line per prompt; stop strings and
eos ids end a completion; a training run prints samples; every bad input exits 2 with a message
naming it (one through the real command line: no traceback)."""
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import BASE_YML, MESH_1, ROOT, train
from MaxText import decode, inference
from MaxText.checkpoint.manager import load_params, save_params_only
from MaxText.config.load import load_config
from MaxText.data import chat_template
from MaxText.models.model_config import ModelConfig
from MaxText.models.registry import init_params

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

WORDS = ["<pad>", "[UNK]", "<|im_start|>", "<|im_end|>", "<s>", "user", "assistant", "system",
         "hello", "world", "how", "are", "you", "fine", "#", "be", "brief"]
TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{ '# ' + (messages[0]['content'] | tojson) + '\\n' }}"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "  {%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}\n"
    "  {%- if message['role'] == 'system' %}{% continue %}{% endif %}\n"
    "  {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- bos_token + ' <|im_start|>assistant\\n' }}{%- endif %}\n")
MESSAGES = [{"role": "system", "content": "be brief é"}, {"role": "user", "content": "hello world"},
            {"role": "assistant", "content": "fine"}, {"role": "user", "content": "how are you"}]


def save_tokenizer(folder, template=TEMPLATE):
  from tokenizers import Tokenizer, models, pre_tokenizers
  tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  fast = transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>", pad_token="<pad>",
      unk_token="[UNK]", additional_special_tokens=["<|im_start|>"])
  if template:
    fast.chat_template = template
  fast.save_pretrained(folder)
  return transformers.AutoTokenizer.from_pretrained(folder)


def test_chat_template_renders_as_transformers(tmp_path):
  hf_tok = save_tokenizer(tmp_path)
  assert os.path.isfile(tmp_path / "chat_template.jinja")
  want = hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
  got = chat_template.render(chat_template.find_template(str(tmp_path)), MESSAGES,
                             chat_template.special_tokens(str(tmp_path)))
  assert got == want and '"be brief é"' in got and "<s> <|im_start|>assistant" in got
  with pytest.raises(Exception, match="unknown role tool"):
    chat_template.render(TEMPLATE, [{"role": "tool", "content": "x"}], {})
  # the template from tokenizer_config.json (no .jinja file): the same text
  os.remove(tmp_path / "chat_template.jinja")
  with open(tmp_path / "tokenizer_config.json", encoding="utf-8") as f:
    config = json.load(f)
  with open(tmp_path / "tokenizer_config.json", "w", encoding="utf-8") as f:
    json.dump({**config, "chat_template": [{"name": "default", "template": TEMPLATE}]}, f)
  assert chat_template.render(chat_template.find_template(str(tmp_path)), MESSAGES,
                              chat_template.special_tokens(str(tmp_path))) == want


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
  """A tiny random Qwen3 (vocab 384) with the tiny tokenizer and its chat template."""
  from hf_parity import build_hf_model
  from test_qwen3_parity import our_config
  from MaxText.models.llama import qwen3_hf_map as hf_map
  folder = tmp_path_factory.mktemp("hf")
  model = build_hf_model(transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
                         hf_map.config_to_hf(our_config(False, True)))
  model.generation_config.eos_token_id = None
  model.save_pretrained(folder)
  return folder, model, save_tokenizer(folder)


def test_hf_folder_chat_decoding_equals_transformers(hf_folder, tmp_path, capsys):
  folder, model, hf_tok = hf_folder
  out = tmp_path / "out.jsonl"
  prompts = tmp_path / "prompts.jsonl"
  with open(prompts, "w", encoding="utf-8") as f:
    f.write(json.dumps({"messages": MESSAGES}) + "\n" + json.dumps({"prompt": "hello"}) + "\n"
            + json.dumps({"prompt_ids": [4, 8, 9, 200]}) + "\n")
  args = [BASE_YML, f"hf_path={folder}", f"prompt_file={prompts}", "chat=true",
          "max_new_tokens=10", f"decode_output={out}", "eos_ids=[3, 17]"]
  assert decode.main(args) == 0
  lines = [json.loads(x) for x in open(out, encoding="utf-8")]
  assert [sorted(x) for x in lines] == [["finish_reason", "output_ids", "output_logprobs",
                                         "prompt_ids", "text"]] * 3
  rendered = [hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"],
              hf_tok.apply_chat_template([{"role": "user", "content": "hello"}],
                                         add_generation_prompt=True)["input_ids"],
              [4, 8, 9, 200]]
  printed = capsys.readouterr().out
  for line, ids in zip(lines, rendered):
    assert line["prompt_ids"] == ids
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=10,
                                           eos_token_id=[3, 17], pad_token_id=0)
    with torch.no_grad():
      want = model.generate(torch.tensor([ids]), generation_config=config)[0, len(ids):].tolist()
    assert line["output_ids"] == want
    assert line["finish_reason"] == ("eos" if want[-1] in (3, 17) else "length")
    assert len(line["output_logprobs"]) == len(want)
    assert line["text"] == hf_tok.decode(want, skip_special_tokens=True)
    # printed: the prompt and its continuation (escaped, no trailing whitespace)
    assert decode.shown(line["text"], want, "continued by the model") in printed
    assert decode.shown(hf_tok.decode(ids, skip_special_tokens=True), ids, "prompt") in printed


def test_converted_checkpoint_decodes_with_its_own_tokenizer(hf_folder, tmp_path):
  """The tokenizer is chosen as training chooses it (resolve/tokenizer_setup.py): the checkpoint's
  own files by default, `tokenizer_path` over them, `tokenizer_type=byte` refused."""
  from MaxText.checkpoint_conversion import to_maxtext
  from MaxText.config.load import ConfigError
  folder, _, hf_tok = hf_folder
  ckpt = tmp_path / "ckpt"
  assert to_maxtext.main([f"hf_path={folder}", f"output_path={ckpt}"]) == 0
  cfg, _ = inference.load_config_for_decoding([BASE_YML, f"load_parameters_path={ckpt}"])
  tok, source = inference.tokenizer_for(cfg)
  assert "the checkpoint's own" in source and tok.eos_id == 3
  assert tok.encode("hello how are you") == hf_tok("hello how are you")["input_ids"]
  other = tmp_path / "other"
  save_tokenizer(other, template=None)
  _, source = inference.tokenizer_for(load_config_for(ckpt, f"tokenizer_path={other}"))
  assert str(other) in source and "the checkpoint's own" not in source
  with pytest.raises(ConfigError, match="tokenizer_type=byte"):
    inference.tokenizer_for(load_config_for(ckpt, "tokenizer_type=byte"))


def load_config_for(ckpt, *overrides):
  return inference.load_config_for_decoding([BASE_YML, f"load_parameters_path={ckpt}",
                                             *overrides])[0]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """A random qwen3-tiny checkpoint (byte tokenizer) with 64 positions."""
  cfg = load_config([BASE_YML, "model_name=qwen3-tiny", "max_position_embeddings=64",
                     "max_target_length=64"])
  path = str(tmp_path_factory.mktemp("ckpt") / "c")
  save_params_only(path, jax.device_get(init_params(ModelConfig.from_config(cfg), 0)), cfg.as_dict())
  return path


def test_api_stop_strings_and_eos(checkpoint):
  model = inference.load([BASE_YML, f"load_parameters_path={checkpoint}"], jax.devices()[:1])
  [free] = model.generate(["def f("], max_new_tokens=30, eos_ids=[-1])
  text = free.text
  stop = text[3:5]                                  # a string the free completion contains
  [cut] = model.generate(["def f("], max_new_tokens=30, stop=[stop], eos_ids=[-1])
  assert cut.finish_reason == "stop" and stop in cut.text and cut.text.startswith(text[:3])
  assert stop not in model.text(cut.output_ids[:-1])   # cut at the token completing it
  eos = free.output_ids[4]
  [ended] = model.generate(["def f("], max_new_tokens=30, eos_ids=[eos])
  assert ended.finish_reason == "eos" and ended.output_ids == free.output_ids[:free.output_ids.index(eos) + 1]
  [score] = model.score([free.prompt_ids], [free.output_ids])
  np.testing.assert_allclose(score, free.output_logprobs, atol=1e-5)


def test_training_prints_samples(tmp_path, capsys):
  code, _, _ = train(tmp_path, "s", *MESH_1, "steps=4", "sample_period=2", "sample_at_end=true",
                     "max_new_tokens=8", "prompt=def ", "sample_temperature=0",
                     "enable_checkpointing=false",
                     devices=jax.devices()[:1])
  out = capsys.readouterr().out
  assert code == 0 and "sample after step 2 (greedy, 8 tokens" in out
  assert out.count("sample after step 4") == 1 and "  | def " in out


def test_bad_input_exits_2(checkpoint, hf_folder, tmp_path, capsys):
  folder = hf_folder[0]
  blank = tmp_path / "p.txt"
  blank.write_text("hello\n\nworld\n")
  empty_json = tmp_path / "p.jsonl"
  empty_json.write_text(json.dumps({"prompt": ""}) + "\n")
  no_template = tmp_path / "tok"
  save_tokenizer(no_template, template=None)
  gone = tmp_path / "gone"
  cfg = load_config([BASE_YML, "model_name=qwen3-tiny", "tokenizer_type=huggingface",
                     f"tokenizer_path={tmp_path / 'nowhere' / 'tokenizer.json'}"])
  # the fixture's weights (the same architecture) under a config whose tokenizer is nowhere: a
  # second init of the same model would only trace and lower it again
  save_params_only(str(gone), load_params(checkpoint), cfg.as_dict())
  ckpt = f"load_parameters_path={checkpoint}"
  cases = [
      ([ckpt, "prompt_ids=" + ",".join(["5"] * 20), "max_cache_length=16"], "max_cache_length"),
      ([ckpt, "prompt_ids=" + ",".join(["5"] * 70)], "max_position_embeddings"),
      ([ckpt, "prompt_ids=5,6,7", "max_new_tokens=62"], "lower max_new_tokens to at most 61"),
      ([ckpt, f"prompt_file={blank}"], "line 2 is an empty prompt"),
      ([ckpt, f"prompt_file={empty_json}"], "prompt 0 is empty"),
      ([ckpt], "exactly one of prompt"),
      ([ckpt, "prompt=hi", "prompt_ids=1"], "exactly one of prompt"),
      ([ckpt, "prompt=hi", "chat=true", f"tokenizer_path={no_template}/tokenizer.json",
        "tokenizer_type=huggingface"], "has no chat template"),
      ([f"load_parameters_path={gone}", "prompt=hi"], "tokenizer files are not in the checkpoint"),
      ([f"hf_path={folder}", ckpt, "prompt=hi"], "both set"),
      ([f"hf_path={tmp_path / 'none'}", "prompt=hi"], f"hf_path: {tmp_path / 'none'}"),
      ([ckpt, "prompt=hi", "temperature=-1"], "temperature"),
  ]
  for args, message in cases:
    assert decode.main([BASE_YML, *args]) == 2, args
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, (args, err)
  # (the command line's exit status is main()'s: `sys.exit(main(sys.argv[1:]))`, the module run
  # as `python -m MaxText.decode` by tests/test_compile_cache.py and test_quantize_recipe.py)


def test_the_python_api_example_of_the_docs_runs_from_another_directory(checkpoint, tmp_path):
  """docs/decoding.md's Python API block, exactly as written, in a process whose working directory
  is not the repository (its relative checkpoint path made there): load finds its default
  configs/base.yml from the package."""
  from conftest import tool_home, xla_flags
  with open(os.path.join(ROOT, "docs", "decoding.md"), encoding="utf-8") as f:
    page = f.read()
  block = page.split("## Python API", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
  assert "inference.load([\"load_parameters_path=runs/default/checkpoints\"])" in block
  work = tmp_path / "work"
  os.makedirs(work / "runs" / "default")
  os.symlink(checkpoint, work / "runs" / "default" / "checkpoints")
  script = block + "print('ok', len(g.output_ids), g.finish_reason)\n"
  env = dict(os.environ, XLA_FLAGS=xla_flags(1), JAX_PLATFORMS="cpu", HOME=tool_home(tmp_path))
  p = subprocess.run([sys.executable, "-c", script], cwd=work, env=env, capture_output=True,
                     text=True, check=False)
  assert p.returncode == 0 and "ok 32 length" in p.stdout, p.stderr[-3000:]
  assert not os.path.exists(work / "configs")
