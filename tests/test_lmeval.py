"""lm-evaluation-harness on our models (MaxText/lmeval/): lm-eval's own `hf` model on a tiny random
Llama (transformers, fp32) is the oracle, and our `maxtext` model — the same weights converted to
our checkpoint by to_maxtext — gives the same per-item results on three small local tasks (jsonl
data, task YAMLs written here): a multiple-choice loglikelihood task (per choice the same
log-likelihood within 1e-4 and the same is_greedy; some choices are the model's greedy text, so
is_greedy is not always false; equal accuracies), a generate_until task (the same text per item;
its stop string cuts some) and a loglikelihood_rolling task (a text longer than max_length, so
several windows). `maxtext` is found by name in lm-eval's registry next to lm-eval's own models;
a key the model does not read is refused naming it."""
import json
import os
import re

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
lm_eval = pytest.importorskip("lm_eval")

from conftest import BASE_YML  # noqa: E402
from hf_parity import build_hf_model  # noqa: E402
from MaxText.config.load import load_config  # noqa: E402
from MaxText.models.llama import hf_map  # noqa: E402

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]        # ids 0..3
CHARS = [chr(c) for c in range(32, 127)]            # printable ASCII, one token each
MAX_LENGTH = 32                                     # both models' max_length: rolling windows
GEN_TOKENS = 12
QUESTIONS = ["Q: 2+2=", "The cat sat on the", "Paris is in", "1, 2, 3,"]
PROMPTS = ["Once upon a", "def f(x):", "abc", "Hello"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")   # printable only
TEXTS = ["short text.", "A longer text that runs past thirty-two tokens, so lm-eval cuts it "
         "into rolling windows."]


def byte_char(b: int) -> str:
  """The character GPT-2's byte-level alphabet writes for byte `b` (tokenizers' ByteLevel)."""
  printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
  return chr(b) if b in printable else chr(256 + sorted(set(range(256)) - set(printable)).index(b))


def save_tokenizer(folder) -> "transformers.PreTrainedTokenizerFast":
  """One token per printable ASCII character (byte-level), <s> added in front as Llama's is."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
  vocab = {t: i for i, t in enumerate(SPECIALS + [byte_char(ord(c)) for c in CHARS])}
  tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
  tok.add_special_tokens(SPECIALS)
  fast = transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
      unk_token="<unk>", clean_up_tokenization_spaces=False)
  fast.chat_template = TEMPLATE
  fast.save_pretrained(folder)
  return transformers.AutoTokenizer.from_pretrained(folder)


def greedy_ids(model, ids: list[int], n: int) -> list[int]:
  with torch.no_grad():
    out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n, pad_token_id=0)
  return out[0, len(ids):].tolist()


def write_tasks(folder, hf_tok, model) -> str:
  """The three task YAMLs and their jsonl data in `folder`; the generate_until task's stop string
  is a character of the model's greedy text for the first prompt (past its first), so it cuts."""
  def jsonl(name, rows):
    path = os.path.join(folder, f"{name}.jsonl")
    with open(path, "w", encoding="utf-8") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)
    return path

  mc = []
  for i, q in enumerate(QUESTIONS):
    ids = greedy_ids(model, hf_tok(q)["input_ids"], 2)
    choices = [" 4", " mat", " Europe"]
    if min(ids) >= len(SPECIALS):                  # printable: a choice the data can hold
      choices.insert(i % 3, hf_tok.decode(ids))
    mc.append({"question": q, "choices": choices, "answer": i % 3 if i % 2 == 0 else 0})
  first = hf_tok.decode(greedy_ids(model, hf_tok(PROMPTS[0])["input_ids"], GEN_TOKENS),
                        skip_special_tokens=True)
  stop = next(c for c in first[1:] if c != first[0])
  gen = [{"prompt": p, "target": first.split(stop)[0] if i == 0 else "x"}
         for i, p in enumerate(PROMPTS)]
  cache = os.path.join(folder, "datasets_cache")
  common = lambda name, rows: {"task": f"tiny_{name}", "dataset_path": "json",
                               "dataset_kwargs": {"data_files": {"test": jsonl(name, rows)},
                                                  "cache_dir": cache},
                               "test_split": "test"}
  tasks = {
      "mc": {**common("mc", mc), "output_type": "multiple_choice", "doc_to_text": "{{question}}",
             "doc_to_choice": "choices", "doc_to_target": "answer", "target_delimiter": "",
             "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}]},
      "gen": {**common("gen", gen), "output_type": "generate_until",
              "doc_to_text": "{{prompt}}", "doc_to_target": "{{target}}",
              "generation_kwargs": {"until": [stop, "\n"], "max_gen_toks": GEN_TOKENS,
                                    "do_sample": False},
              "metric_list": [{"metric": "exact_match"}]},
      "rolling": {**common("rolling", [{"text": t} for t in TEXTS]),
                  "output_type": "loglikelihood_rolling", "doc_to_text": "",
                  "doc_to_target": "{{text}}",
                  "metric_list": [{"metric": "word_perplexity"}, {"metric": "bits_per_byte"}]},
  }
  import yaml
  for name, task in tasks.items():
    with open(os.path.join(folder, f"{name}.yaml"), "w", encoding="utf-8") as f:
      yaml.safe_dump(task, f)
  return stop


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  """(HF folder, our checkpoint of it, the tasks' folder, the generate_until stop string)."""
  from MaxText.checkpoint_conversion import to_maxtext
  root = tmp_path_factory.mktemp("lmeval")
  hf, ckpt, tasks = (str(root / n) for n in ("hf", "ckpt", "tasks"))
  os.makedirs(tasks)
  hf_tok = save_tokenizer(hf)
  assert hf_tok("a b")["input_ids"] == [1, *(4 + CHARS.index(c) for c in "a b")]
  cfg = load_config([BASE_YML, "emb_dim=64", "num_decoder_layers=2", "num_query_heads=4",
                     "num_kv_heads=2", "head_dim=16", "mlp_dim=128", "max_position_embeddings=512",
                     f"vocab_size={len(SPECIALS) + len(CHARS)}", "hf_model_type=llama"])
  model = build_hf_model(transformers.LlamaConfig, transformers.LlamaForCausalLM,
                         {**hf_map.config_to_hf(cfg), "bos_token_id": 1, "eos_token_id": 2,
                          "pad_token_id": 0})
  model.generation_config.eos_token_id = 2
  model.save_pretrained(hf)
  assert to_maxtext.main([f"hf_path={hf}", f"output_path={ckpt}"]) == 0
  stop = write_tasks(tasks, hf_tok, model)
  return hf, ckpt, tasks, stop


def evaluate(model, tasks_dir, tasks=("tiny_mc", "tiny_gen", "tiny_rolling"), **kwargs):
  """lm-eval's simple_evaluate, without the environment report it adds to the results (torch's
  collect_env: `pip list` and other probes in subprocesses, ~1.5 CPU s a call, read by no test;
  the documented command's own process keeps it)."""
  from unittest import mock

  from lm_eval.tasks import TaskManager
  with mock.patch("lm_eval.evaluator.add_env_info", lambda storage: None):
    return lm_eval.simple_evaluate(model=model, tasks=list(tasks),
                                   task_manager=TaskManager(include_path=tasks_dir,
                                                            include_defaults=False),
                                   log_samples=True, bootstrap_iters=0, **kwargs)


def hf_args(setup) -> dict:
  return {"pretrained": setup[0], "dtype": "float32", "device": "cpu", "max_length": MAX_LENGTH}


@pytest.fixture(scope="module")
def hf_results(setup):
  return evaluate("hf", setup[2], model_args=hf_args(setup), batch_size=1)


@pytest.fixture(scope="module")
def ours(setup):
  """Our `maxtext` model on the converted checkpoint (fp32, one device)."""
  from MaxText.lmeval.model import MaxTextLM
  return MaxTextLM(load_parameters_path=setup[1], dtype="float32", max_length=MAX_LENGTH,
                   batch_size=4, devices=jax.devices()[:1])


def per_item(results, task):
  return sorted(results["samples"][task], key=lambda s: s["doc_id"])


def test_registered_next_to_lm_evals_own_models():
  import MaxText.lmeval  # noqa: F401
  from lm_eval.api.registry import get_model
  from MaxText.lmeval.model import MaxTextLM
  assert get_model("maxtext") is MaxTextLM
  assert get_model("hf").__name__ == "HFLM" and get_model("local-completions")


def test_maxtext_gives_hf_per_item_results(setup, hf_results, ours):
  tasks, stop = setup[2], setup[3]
  got = evaluate(ours, tasks)
  # multiple choice: each choice's log-likelihood and is_greedy; the accuracies
  want_mc, got_mc = per_item(hf_results, "tiny_mc"), per_item(got, "tiny_mc")
  assert [s["doc_id"] for s in got_mc] == list(range(len(QUESTIONS)))
  greedy = 0
  for w, g in zip(want_mc, got_mc):
    (w_ll, w_greedy), (g_ll, g_greedy) = (np.array(x["filtered_resps"], dtype=object).T
                                          for x in (w, g))
    np.testing.assert_allclose(g_ll.astype(float), w_ll.astype(float), atol=1e-4, rtol=0)
    assert list(g_greedy) == list(w_greedy)
    greedy += sum(w_greedy)
    assert (g["acc"], g["acc_norm"]) == (w["acc"], w["acc_norm"])
  assert greedy >= 1          # some choices are the greedy text: is_greedy is checked both ways
  for metric in ("acc,none", "acc_norm,none"):
    assert got["results"]["tiny_mc"][metric] == hf_results["results"]["tiny_mc"][metric]
  # generate_until: the same text per item, cut at the stop string
  want_gen = [s["filtered_resps"][0] for s in per_item(hf_results, "tiny_gen")]
  assert [s["filtered_resps"][0] for s in per_item(got, "tiny_gen")] == want_gen
  assert any(want_gen) and stop not in "".join(want_gen)
  assert got["results"]["tiny_gen"]["exact_match,none"] == \
      hf_results["results"]["tiny_gen"]["exact_match,none"] > 0
  # loglikelihood_rolling: the windows' sum per text
  want_roll = [s["filtered_resps"][0] for s in per_item(hf_results, "tiny_rolling")]
  got_roll = [s["filtered_resps"][0] for s in per_item(got, "tiny_rolling")]
  np.testing.assert_allclose(got_roll, want_roll, atol=1e-4, rtol=0)


def test_chat_template_generations_equal_hf(setup, ours):
  """--apply_chat_template: the tokenizer's own template (its bos written by the template, not
  added again), the same generations as hf's."""
  want = evaluate("hf", setup[2], ["tiny_gen"], model_args=hf_args(setup), batch_size=1,
                  apply_chat_template=True)
  got = evaluate(ours, setup[2], ["tiny_gen"], apply_chat_template=True)
  texts = lambda r: [s["filtered_resps"][0] for s in per_item(r, "tiny_gen")]
  prompts = lambda r: [s["arguments"] for s in per_item(r, "tiny_gen")]
  assert prompts(got) == prompts(want) and "[assistant] " in str(prompts(got)[0])
  assert texts(got) == texts(want) and any(texts(want))


def test_a_key_the_model_does_not_read_is_refused(setup):
  from MaxText.config.load import ConfigError
  from MaxText.lmeval.model import MaxTextLM
  with pytest.raises(ConfigError, match="prompt='hi'.*does not read prompt"):
    MaxTextLM(load_parameters_path=setup[1], prompt="hi", devices=jax.devices()[:1])


def test_the_documented_command_prints_its_table(setup, tmp_path):
  """docs/decoding.md's first lm-eval command, as written there (`python -m MaxText.lmeval --model
  maxtext`, the local task shipped in end_to_end/data/lmeval/), on the tiny checkpoint in place of
  the page's runs/tiny/checkpoints, offline: lm-eval's results table on stdout, exit 0 (it used to
  die writing the table: pytz missing). The task file the page shows is the shipped one."""
  import subprocess
  import sys

  import yaml
  from conftest import ROOT, tool_home, xla_flags
  from docs_blocks import blocks, commands, page, split_command
  section = blocks(page("decoding.md"), "lm-evaluation-harness")
  [first] = [c for _, body in section[:1] for c in commands(body)][:1]
  env, words = split_command(first)
  assert words[:3] == [".venv/bin/python", "-m", "MaxText.lmeval"] and not env
  assert "load_parameters_path=runs/tiny/checkpoints" in words
  words = [w.replace("runs/tiny/checkpoints", setup[1]) for w in words]
  shown = [yaml.safe_load(body) for lang, body in section if lang == "yaml"]
  with open(os.path.join(ROOT, "end_to_end", "data", "lmeval", "tiny_python.yaml"),
            encoding="utf-8") as f:
    assert shown == [yaml.safe_load(f)]
  done = subprocess.run(
      [sys.executable, *words[1:]], cwd=ROOT, capture_output=True, text=True, check=False,
      env={**os.environ, "HOME": tool_home(tmp_path), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": xla_flags(1), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
  assert done.returncode == 0, done.stderr[-3000:]
  assert "Traceback" not in done.stderr
  rows = [line for line in done.stdout.splitlines() if line.startswith("|")]
  assert rows and rows[0].replace(" ", "").startswith("|Tasks|Version|Filter|n-shot|Metric|")
  acc = [r for r in rows if re.match(r"\|tiny_python\s*\|.*\|acc\s*\|", r)]
  assert len(acc) == 1, done.stdout[-3000:]
  value = float(acc[0].split("|")[7])
  assert 0.0 <= value <= 1.0 and value * 8 == round(value * 8)   # a share of the 8 items
