"""MaxText.inspect as an evaluation tool's white-box backend, against transformers (the oracle) on a
tiny random Llama saved as a Hugging Face folder with a byte-level BPE tokenizer (merges, so
tokens span several characters) and a local chat template that uses `tools`, `enable_thinking`
and `{% generation %}`:
  - capabilities from the config alone equal the loaded model's; an attention capture the
    attention setting cannot give fails before anything compiles;
  - encodings: ids and token strings (via offsets) equal the tokenizer's, the chat text and ids
    equal `apply_chat_template(tools=, enable_thinking=)`, the assistant span equals its
    `assistant_masks`, the user / system spans hold their messages' text;
  - top-k log-probabilities (given completions and greedy-then-score) equal torch's log-softmax
    of transformers' logits within 1e-5, the greedy ids transformers' greedy ids;
  - unseeded sampling differs call to call, a seed repeats; 4 threads give the serial results;
  - 50 prompt lengths (5..500) compile at most 8 forward programs, equal to unpadded runs within
    1e-6, and at most 8 scoring programs;
  - forward(to="torch") is bit-exact in bf16, and torch is not imported otherwise;
  - final_norm_params rebuild the lens (every family of test_inspect) and equal transformers'.
"""
import json
import os
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import BASE_YML  # noqa: E402
from hf_parity import build_hf_model  # noqa: E402
from MaxText import inspect as mi  # noqa: E402
from MaxText.config.load import load_config  # noqa: E402
from MaxText.models.llama import hf_map  # noqa: E402
from test_lmeval import byte_char  # noqa: E402

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
CHAT_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<think>", "</think>"]
CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
MERGES = [("t", "h"), ("th", "e"), ("Ġ", "the"), ("i", "s"), ("Ġ", "a"), ("o", "n")]
TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>Tools: {% for t in tools %}{{ t | tojson }}"
    "{% endfor %}<|end|>\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{% if m['role'] == 'assistant' %}"
    "{% generation %}{{ m['content'] }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}"
    "<|end|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}}}}]
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Is the sky blue?"},
            {"role": "assistant", "content": "Yes, on a clear day."},
            {"role": "user", "content": "And the sea?"}]
TOL = 1e-5


def save_tokenizer(folder):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers
  from tokenizers import processors
  pieces = [byte_char(ord(c)) for c in CHARS]
  merged = ["".join(m).replace(" ", "") for m in MERGES]
  vocab = {t: i for i, t in enumerate(SPECIALS + pieces + merged)}
  tok = Tokenizer(models.BPE(vocab, MERGES, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
  tok.add_special_tokens(SPECIALS + CHAT_TOKENS)
  fast = transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
      unk_token="<unk>", clean_up_tokenization_spaces=False)
  fast.chat_template = TEMPLATE
  fast.save_pretrained(folder)
  return transformers.AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  """(HF folder, HF tokenizer, HF model, our inspection model of it: fp32, one device)."""
  folder = str(tmp_path_factory.mktemp("backend") / "hf")
  hf_tok = save_tokenizer(folder)
  assert len(hf_tok("the")["input_ids"]) == 2          # <s> "the": merges are in use
  cfg = load_config([BASE_YML, "emb_dim=32", "num_decoder_layers=2", "num_query_heads=4",
                     "num_kv_heads=2", "head_dim=8", "mlp_dim=64", "max_position_embeddings=1024",
                     f"vocab_size={len(hf_tok)}", "hf_model_type=llama"])
  model = build_hf_model(transformers.LlamaConfig, transformers.LlamaForCausalLM,
                         {**hf_map.config_to_hf(cfg), "bos_token_id": 1, "eos_token_id": 2,
                          "pad_token_id": 0})
  model.generation_config.eos_token_id = None
  model.save_pretrained(folder)
  m = mi.load(hf_path=folder, devices=jax.devices()[:1])
  return folder, hf_tok, model, m


def hf_logprobs(model, ids) -> np.ndarray:
  with torch.no_grad():
    logits = model(torch.tensor([ids]), use_cache=False).logits[0].double()
  return torch.log_softmax(logits, -1).numpy()


# ---- capabilities, lens parameters ---------------------------------------------------------------
def test_capabilities_from_the_config_alone_equal_the_loaded_models(setup):
  folder, _, _, m = setup
  before = mi.capabilities(hf_path=folder)
  assert before == m.capabilities
  assert before.as_dict() == {**before.as_dict(), "generate": True, "logprobs": True,
                              "attentions": True, "chat": True, "images": False, "audio": False,
                              "attention_op": "dot_product"}


def test_an_attention_capture_the_setting_cannot_give_fails_before_any_work(setup):
  """A model configured with the flash kernel, inspected with its own op (attention="model"):
  no attention probabilities, declared before loading; asking for them fails before anything is
  traced. The reference setting (the default) gives them whatever the model trained with."""
  folder, _, _, m = setup
  flash = ["attention=flash"]
  caps = mi.capabilities(hf_path=folder, overrides=flash, attention="model")
  assert not caps.attentions and caps.attention_op == "flash" and caps.hidden_states
  assert mi.capabilities(hf_path=folder, overrides=flash).attentions
  f = mi.load(hf_path=folder, overrides=flash, attention="model", devices=jax.devices()[:1])
  assert f.capabilities == caps
  for capture in (["attentions"], ["attn_pattern.1"], ["attn_scores.*", "logits"]):
    with pytest.raises(ValueError, match="attention='flash'"):
      f.forward([1, 5, 9], capture=capture)
  assert f.compiled_programs() == 0                               # nothing was traced
  with pytest.raises(ValueError, match="attention="):
    mi.load(hf_path=folder, attention="fast")


@pytest.mark.parametrize("model_name,takes,want", [
    ("qwen3-tiny", ("image", "audio"), {"images": False, "audio": False}),
    ("qwen3-next-tiny", (), {"images": False, "audio": False}),
    ("gemma4-tiny", ("image",), {"images": False, "audio": False}),     # no tower: no images
    ("gemma4-mm-tiny", ("image",), {"images": True, "audio": False}),   # its processor: images
    ("gemma4-mm-tiny", (), {"images": False, "audio": False})])         # no processor: none
def test_capabilities_per_family(model_name, takes, want):
  from MaxText.models.model_config import ModelConfig
  mcfg = ModelConfig.from_config(load_config([BASE_YML, f"model_name={model_name}"]))
  caps = mi.capabilities_of(mcfg, chat=True, processor_takes=takes)
  assert {k: getattr(caps, k) for k in want} == want
  assert caps.generate and caps.logprobs and caps.attentions and caps.gradients


# ---- encodings ---------------------------------------------------------------------------------
def test_a_text_encoding_equals_the_tokenizers(setup):
  _, hf_tok, _, m = setup
  text = "the cat is on the mat"
  e = m.encode(text)
  want = hf_tok(text, return_offsets_mapping=True)
  assert e.ids == want["input_ids"] and e.text == text
  assert e.offsets[0] is None and e.tokens[0] == "<s>"            # the bos the tokenizer adds
  assert [tuple(o) for o in want["offset_mapping"][1:]] == e.offsets[1:]
  assert e.tokens[1:] == [text[a:b] for a, b in want["offset_mapping"][1:]]
  assert any(len(t) > 1 for t in e.tokens[1:])                     # merged tokens
  assert list(e.type_names()) == ["text"] * len(e.ids) and e.spans == []
  t = m.forward(text, capture=["logits"])
  assert (t.encoding.tokens, t.encoding.offsets) == (e.tokens, e.offsets)
  assert list(t.tokens) == e.ids
  # the pictures' labels: special tokens by their own strings (transformers' tokens), not `<1>`
  assert m.token_text(e.ids) == e.tokens
  assert m.token_text([1, 2, 0]) == hf_tok.convert_ids_to_tokens([1, 2, 0]) == ["<s>", "</s>", "<pad>"]


def test_a_byte_tokenizers_labels_name_its_special_tokens():
  from MaxText.data.tokenizers import ByteTokenizer, token_label
  tok = ByteTokenizer()
  assert [token_label(tok, i) for i in [1, *tok.encode("a "), 2, 0]] == ["<bos>", "a", " ", "<eos>",
                                                                          "<pad>"]
  assert token_label(None, 7) == "<7>"


def test_a_chat_encoding_equals_apply_chat_template_with_tools_and_thinking(setup):
  _, hf_tok, _, m = setup
  e = m.encode(MESSAGES, tools=TOOLS, chat_template_kwargs={"enable_thinking": False})
  text = hf_tok.apply_chat_template(MESSAGES, tools=TOOLS, enable_thinking=False,
                                    add_generation_prompt=True, tokenize=False)
  assert e.text == text and "get_weather" in text and text.endswith("<think></think>")
  assert e.ids == hf_tok(text, add_special_tokens=False)["input_ids"]
  # the decoding path renders the same (a prompt object with tools and chat_template_kwargs)
  prompt = {"messages": MESSAGES, "tools": TOOLS, "chat_template_kwargs": {"enable_thinking": False}}
  assert m.inference.encode(prompt) == e.ids
  assert m.inference.encode({"messages": MESSAGES}) != e.ids        # the options change it
  # spans: the assistant's tokens are transformers' assistant mask
  out = hf_tok.apply_chat_template(MESSAGES, tools=TOOLS, enable_thinking=False, tokenize=True,
                                   return_dict=True, return_assistant_tokens_mask=True)
  mask = np.asarray(out["assistant_masks"], bool)
  ours = e.select(role="assistant")
  assert mask.any() and np.array_equal(ours[:len(mask)], mask) and not ours[len(mask):].any()
  assert [(s.role, s.message) for s in e.spans] == [(mm["role"], i) for i, mm in
                                                     enumerate(MESSAGES)]
  for s in e.spans:
    assert "".join(e.tokens[s.start:s.end]) == MESSAGES[s.message]["content"]
  t = m.forward({"messages": MESSAGES}, capture=["logits"])
  assert t.encoding.ids == list(t.tokens) and t.encoding.spans[1].role == "user"


def test_sft_renders_tools_and_thinking_as_apply_chat_template(setup):
  """SFT records with `tools` and `chat_template_kwargs`: transformers' ids and assistant mask,
  with the template's {% generation %} blocks and without them (prefix spans)."""
  from MaxText.data import sft, tokenizers
  folder, hf_tok, _, _ = setup
  tok = tokenizers.HFTokenizer(os.path.join(folder, "tokenizer.json"))
  tagged = sft.ChatFormat.for_tokenizer(os.path.join(folder, "tokenizer.json"))
  untagged = TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
  plain = sft.ChatFormat(untagged, tagged.tokens)
  conversation = MESSAGES[:3]
  # (without tags, the spans need the generation prompt to be a prefix: enable_thinking=True)
  for fmt, thinking in ((tagged, False), (plain, True)):
    record = {"messages": conversation, "tools": TOOLS,
              "chat_template_kwargs": {"enable_thinking": thinking}}
    want = hf_tok.apply_chat_template(conversation, tools=TOOLS, enable_thinking=thinking,
                                      tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
    ids, mask = sft.tokenize_chat(fmt, tok, sft.messages_of(record), sft.options_of(record))
    assert ids.tolist() == list(want["input_ids"])
    content = np.asarray(want["assistant_masks"], bool)
    if fmt is tagged:
      assert mask.tolist() == content.astype(int).tolist() and content.any()
    else:   # the content and the template's end-of-turn token after it
      extra = np.nonzero(mask.astype(bool) & ~content)[0]
      assert (mask.astype(bool) >= content).all() and len(extra) == 1
      assert hf_tok.convert_ids_to_tokens(int(ids[extra[0]])) == "<|end|>"
  plain_ids, _ = sft.tokenize_chat(tagged, tok, conversation)
  assert plain_ids.tolist() != list(want["input_ids"])          # the options matter
  with pytest.raises(sft.DataError, match="tools"):
    sft.options_of({"messages": conversation, "tools": "get_weather"})


# ---- log-probabilities, sampling, threads --------------------------------------------------------
def test_top_k_logprobs_equal_torch_log_softmax(setup):
  _, hf_tok, model, m = setup
  prompt, completion = hf_tok("the sea")["input_ids"], hf_tok(" is blue", add_special_tokens=False)[
      "input_ids"]
  [s] = m.logprobs([prompt], [completion], top_k=5)
  want = hf_logprobs(model, prompt + completion)[len(prompt) - 1:-1]
  assert s.ids.tolist() == completion and s.top_ids.shape == (len(completion), 5)
  np.testing.assert_allclose(s.logprobs, want[np.arange(len(completion)), completion], atol=TOL)
  order = np.argsort(-want, axis=-1, kind="stable")[:, :5]
  assert np.array_equal(s.top_ids, order)
  np.testing.assert_allclose(s.top_logprobs, np.take_along_axis(want, order, -1), atol=TOL)
  [plain] = m.logprobs([prompt], [completion])
  np.testing.assert_array_equal(plain, s.logprobs)


def test_greedy_then_score_in_one_call(setup):
  _, hf_tok, model, m = setup
  prompts = [hf_tok("the sea")["input_ids"], hf_tok("on a")["input_ids"]]
  got = m.logprobs(prompts, top_k=3, max_new_tokens=6)
  for p, s in zip(prompts, got):
    with torch.no_grad():
      greedy = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=6,
                              pad_token_id=0)[0, len(p):].tolist()
    assert s.ids.tolist() == greedy and s.greedy.all()
    want = hf_logprobs(model, p + greedy)[len(p) - 1:-1]
    np.testing.assert_allclose(s.logprobs, want[np.arange(6), greedy], atol=TOL)
    np.testing.assert_allclose(s.top_logprobs[:, 0], want.max(-1), atol=TOL)


def test_unseeded_sampling_differs_and_a_seed_repeats(setup):
  _, hf_tok, _, m = setup
  prompts = [hf_tok("the")["input_ids"], hf_tok("sea")["input_ids"]]
  kw = {"max_new_tokens": 12, "temperature": 1.0}
  a = m.generate(prompts, **kw)
  seed_a = m.last_seed
  b = m.generate(prompts, **kw)
  assert seed_a != m.last_seed and [g.output_ids for g in a] != [g.output_ids for g in b]
  again = m.generate(prompts, seed=seed_a, **kw)
  assert [g.output_ids for g in again] == [g.output_ids for g in a]
  alone = m.generate(prompts[:1], seed=seed_a, **kw)            # another batch, the same row
  assert alone[0].output_ids == a[0].output_ids


def test_four_threads_give_the_serial_results(setup):
  _, hf_tok, _, m = setup
  prompts = [hf_tok(t)["input_ids"] for t in ("the sea", "on a mat", "is", "the cat is")]

  # top_k=5 on one row: the scoring program test_top_k_logprobs_equal_torch_log_softmax compiled
  def work(p):
    t = m.forward(p, capture=["logits", "resid_post.0"])
    return (t.logits, t.sites["resid_post.0"], m.logprobs([p], top_k=5, max_new_tokens=4)[0],
            m.generate([p], max_new_tokens=4, temperature=1.0, seed=3)[0].output_ids)

  serial = [work(p) for p in prompts]
  results: list = [None] * 4
  start = threading.Barrier(4)

  def run(i):
    start.wait()
    for _ in range(2):
      results[i] = work(prompts[i])

  threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  for want, got in zip(serial, results):
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[2].top_ids, want[2].top_ids)
    np.testing.assert_array_equal(got[2].logprobs, want[2].logprobs)
    assert got[3] == want[3]


# ---- bounded compiles ----------------------------------------------------------------------------
WORST = [0.0]


def assert_near(got, want):
  """|got - want| within test_inspect's fp32 bound (of the array's largest magnitude, at least 1):
  the padded program adds the same terms (the padding's attention weights are exactly 0), but
  XLA:CPU blocks the contractions of another shape differently, so the roundings differ."""
  from test_inspect import tolerance
  err, scale = float(np.abs(got - want).max()), max(1.0, float(np.abs(want).max()))
  WORST[0] = max(WORST[0], err / scale)
  assert err <= tolerance(MCFG[0]) * scale, (err, scale)


MCFG: list = [None]


def test_fifty_prompt_lengths_compile_a_handful_of_programs(setup):
  _, _, _, m = setup
  MCFG[0] = m.mcfg
  rng = np.random.default_rng(0)
  lengths = np.unique(np.linspace(5, 500, 50).astype(int))
  assert len(lengths) == 50
  prompts = [rng.integers(4, m.mcfg.vocab_size, n).tolist() for n in lengths]
  m.forward(prompts[0], capture=["logits", "hidden_states"])     # warm: nothing else counts
  before = m._traces
  traces = [m.forward(p, capture=["logits", "hidden_states"]) for p in prompts]
  compiled = m._traces - before
  assert 1 <= compiled <= 8, compiled
  # against the unpadded run: each length bucket's shortest prompt (the most padding its program
  # adds), every bucket once (one program each: a second length of a bucket runs its program again)
  from MaxText.inspect.model import MIN_LENGTH_BUCKET, bucket
  first = {}
  for i, p in enumerate(prompts):
    first.setdefault(bucket(len(p), MIN_LENGTH_BUCKET), i)
  assert len(first) == 6                                         # 16, 32, ... 512
  for i in first.values():
    p, t = prompts[i], traces[i]
    exact = m.forward(p, capture=["logits", "hidden_states"], buckets=False)
    assert t.logits.shape == exact.logits.shape == (len(p), m.mcfg.vocab_size)
    for got, want in [(t.logits, exact.logits), *zip(t.hidden_states, exact.hidden_states)]:
      assert_near(got, want)
  batch = m.forward(prompts[3:6], capture=["logits"])           # a batch: 3 rows → 4
  for i, p in enumerate(prompts[3:6]):
    assert_near(batch.logits[i, :len(p)], traces[3 + i].logits)
  engine = m.inference.engine
  before = engine.compiled_programs()
  for p in prompts:
    m.logprobs([p[:-2]], [p[-2:]])
  assert engine.compiled_programs() - before <= 8
  print(f"50 prompt lengths: {compiled} forward programs, "
        f"{engine.compiled_programs() - before} scoring programs; worst |padded - exact| / "
        f"max|x| = {WORST[0]:.1e} (bound {__import__('test_inspect').tolerance(m.mcfg):.1e})")


# ---- the torch boundary --------------------------------------------------------------------------
def test_to_torch_is_bit_exact_in_bf16(setup):
  folder, _, _, _ = setup
  m = mi.load(hf_path=folder, overrides=["dtype=bfloat16"], devices=jax.devices()[:1])
  t = m.forward([1, 5, 9, 30], capture=["hidden_states", "logits", "resid_post.0"])
  tt = m.forward([1, 5, 9, 30], capture=["hidden_states", "logits", "resid_post.0"], to="torch")
  assert t.hidden_states[1].dtype.name == "bfloat16" and tt.hidden_states[1].dtype == torch.bfloat16
  for a, b in [*zip(t.hidden_states, tt.hidden_states), (t.sites["resid_post.0"],
                                                         tt.sites["resid_post.0"])]:
    assert np.array_equal(np.asarray(a).view(np.int16), b.view(torch.int16).numpy())
  assert np.array_equal(t.logits, tt.logits.numpy()) and tt.tokens.tolist() == [1, 5, 9, 30]


def test_torch_is_imported_only_for_the_torch_boundary(setup):
  folder = setup[0]
  code = ("import sys, jax; from MaxText import inspect as mi; "
          f"m = mi.load(hf_path={folder!r}, devices=jax.devices()[:1]); "
          "m.forward('the sea', capture=['logits']); print('torch' in sys.modules)")
  env = {**os.environ, "PYTHONPATH": os.getcwd(), "JAX_PLATFORMS": "cpu"}
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       check=True, timeout=300)
  assert out.stdout.strip().splitlines()[-1] == "False", out.stdout + out.stderr


def test_wrap_takes_parameters_in_memory(setup):
  _, _, _, m = setup
  w = mi.wrap(m.params, m.inference.cfg, devices=jax.devices()[:1])
  np.testing.assert_array_equal(w.forward([1, 5, 9]).logits, m.forward([1, 5, 9]).logits)
  assert json.dumps(w.capabilities.as_dict())


# ---- lens parameters ---------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen3", "gemma4", "qwen3_next"])
def test_final_norm_params_rebuild_the_lens_and_equal_transformers(family):
  """NumPy's lens from final_norm_params + unembed_weight equals m.lens; the scale, eps and
  soft-cap are transformers' (Gemma 4: soft-capped; Qwen3-Next: zero-centred)."""
  import test_inspect
  m = test_inspect.inspector(family)
  p = m.final_norm_params()
  h = np.random.default_rng(1).normal(size=(3, m.mcfg.emb_dim)).astype(np.float32)
  x = h / np.sqrt(np.mean(h * h, -1, keepdims=True) + p["eps"])
  y = x * ((1.0 + p["scale"]) if p["zero_centered"] else p["scale"])
  logits = y @ m.unembed_weight().T.astype(np.float32)
  if p["softcap"]:
    logits = p["softcap"] * np.tanh(logits / p["softcap"])
  test_inspect.close(logits, m.lens(h), "numpy lens", m)
  model = test_inspect.hf(family)
  config = model.config.get_text_config()
  sd = {k: v for k, v in model.state_dict().items() if k.endswith("norm.weight")}
  final = min((k for k in sd if k.split(".")[-2] == "norm"), key=len)
  np.testing.assert_array_equal(p["scale"], sd[final].float().numpy())
  assert p["eps"] == pytest.approx(config.rms_norm_eps)
  assert p["softcap"] == (getattr(config, "final_logit_softcapping", None) or 0.0)
  assert p["zero_centered"] == (family == "qwen3_next")
  assert (p["softcap"] > 0) == (family == "gemma4")


# ---- contrastive decoding ------------------------------------------------------------------------
def numpy_contrastive_greedy(model, prompt, contrast, alpha, n) -> list[int]:
  """The oracle: transformers' logits of both streams, fused in NumPy, argmax, token by token."""
  out = []
  for _ in range(n):
    with torch.no_grad():
      pos = model(torch.tensor([prompt + out]), use_cache=False).logits[0, -1].numpy()
      neg = model(torch.tensor([contrast + out]), use_cache=False).logits[0, -1].numpy()
    fused = (1 + alpha) * pos.astype(np.float64) - alpha * neg.astype(np.float64)
    out.append(int(np.argmax(fused)))
  return out


def test_contrastive_greedy_equals_a_numpy_fusion_of_the_two_streams(setup):
  _, hf_tok, model, m = setup
  pairs = [("Answer: the sea is", "Ignore this: the sea is"), ("on a mat the", "the"),
           ("is the cat on", "is the sea on a")]
  prompts = [hf_tok(p)["input_ids"] for p, _ in pairs]
  contrasts = [hf_tok(c)["input_ids"] for _, c in pairs]
  got = m.contrastive_generate(prompts, contrasts, alpha=1.5, max_new_tokens=8)
  plain = m.generate(prompts, max_new_tokens=8, temperature=0.0)
  for p, c, g in zip(prompts, contrasts, got):
    assert g.output_ids == numpy_contrastive_greedy(model, p, c, 1.5, 8)
    assert len(g.output_ids) == 8 and g.finish_reason == "length"
  assert [g.output_ids for g in got] != [g.output_ids for g in plain]   # the contrast matters
  zero = m.contrastive_generate(prompts, contrasts, alpha=0.0, max_new_tokens=8)
  assert [g.output_ids for g in zero] == [g.output_ids for g in plain]   # alpha 0: the prompt
  for a, b in zip(zero, plain):
    np.testing.assert_allclose(a.output_logprobs, b.output_logprobs, atol=TOL)
  with pytest.raises(ValueError, match="alpha"):
    m.contrastive_generate(prompts, contrasts, alpha=-1.0, max_new_tokens=2)


# ---- LoRA repair -------------------------------------------------------------------------------
def test_lora_repair_in_process_and_its_peft_export(setup, tmp_path):
  """lora_finetune lowers the pool's loss, leaves m as it was, and m2's PEFT export on
  transformers + peft gives m2's logits."""
  peft = pytest.importorskip("peft")
  folder, hf_tok, _, m = setup
  pool = [("the sea is", " blue"), ("the cat is", " on the mat"), ("is the sky", " blue"),
          ("on a", " mat")]
  ids = hf_tok("the cat is on a mat")["input_ids"]
  before = m.forward(ids, capture=["logits"]).logits
  base_nll = -sum(lp.sum() for lp in m.logprobs([p for p, _ in pool], [t for _, t in pool]))
  from MaxText import repair
  m2 = repair.repairable(m).lora_finetune(pool, rank=4, steps=25, learning_rate=1e-2)
  nll = -sum(lp.sum() for lp in m2.logprobs([p for p, _ in pool], [t for _, t in pool]))
  assert nll < 0.5 * base_nll, (base_nll, nll)
  assert m2.lora_losses[-1] < m2.lora_losses[0]
  np.testing.assert_array_equal(m.forward(ids, capture=["logits"]).logits, before)   # m unchanged
  assert m.inference.cfg.lora_rank == 0 and m2.inference.cfg.lora_rank == 4
  modules = m2.save_peft(str(tmp_path / "peft"))
  assert modules and os.path.isfile(tmp_path / "peft" / "adapter_config.json")
  base = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
  hf2 = peft.PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()
  with torch.no_grad():
    want = hf2(torch.tensor([ids]), use_cache=False).logits[0].numpy()
  got = m2.forward(ids, capture=["logits"]).logits
  assert np.abs(got - want).max() <= 1e-4, np.abs(got - want).max()
  assert np.abs(got - before).max() > 1e-2                        # the adapters changed them
  print(f"LoRA repair: pool NLL {base_nll:.2f} -> {nll:.2f}; |ours - peft| = "
        f"{np.abs(got - want).max():.1e}")


def test_visual_contrastive_greedy_equals_a_numpy_fusion(tmp_path):
  """Visual-contrastive decoding on a tiny Gemma 4 with its vision tower: the same chat message
  with an image and with another (the contrast); each greedy token is the argmax of transformers'
  two teacher-forced logit streams (the processor's tensors) fused in NumPy."""
  import test_multimodal_inputs as mm
  from test_gemma4_vision import BOI, EOI, IMAGE as IMAGE_ID, hf_model
  model = hf_model()
  special = {376: mm.TOKENS["boa_token"], 377: mm.TOKENS["eoa_token"], BOI: mm.TOKENS["boi_token"],
             EOI: mm.TOKENS["eoi_token"], IMAGE_ID: mm.TOKENS["image_token"], 381: "<|video|>",
             382: mm.TOKENS["audio_token"]}
  rest = [w for w in mm.WORDS if w not in special.values()]
  words = [special.get(i) or (rest[i] if i < len(rest) else f"w{i}")
           for i in range(model.config.text_config.vocab_size)]
  hf_dir = tmp_path / "hf"
  model.save_pretrained(hf_dir)
  oracle = mm.build_processor_folder(hf_dir, words=tuple(words), image=dict(
      patch_size=2, max_soft_tokens=70, pooling_kernel_size=2))
  images = mm.write_images(tmp_path)
  chat = lambda image: [{"role": "user", "content": [{"type": "image", "image": image},
                                                     {"type": "text", "text": "what is this"}]}]
  m = mi.load(hf_path=str(hf_dir), devices=jax.devices()[:1])
  alpha, n = 1.0, 6
  [g] = m.contrastive_generate([{"messages": chat(images[0])}], [{"messages": chat(images[1])}],
                               alpha=alpha, max_new_tokens=n, eos_ids=[])
  streams = [oracle.apply_chat_template(chat(im), add_generation_prompt=True, tokenize=True,
                                        return_dict=True, return_tensors="pt")
             for im in images[:2]]
  assert g.prompt_ids == streams[0]["input_ids"][0].tolist()
  # the Encoding of the image prompt: the processor's ids and token types, the image's grid
  e = m.encode(chat(images[0]))
  assert e.ids == g.prompt_ids
  assert e.token_types.tolist() == streams[0]["mm_token_type_ids"][0].tolist()
  assert e.select(kind="image").sum() == (streams[0]["mm_token_type_ids"][0] == 1).sum() > 0
  assert len(e.image_grids) == 1 and e.spans[0].role == "user"
  assert e.tokens[e.spans[0].start:e.spans[0].end][-3:] == ["what", "is", "this"]   # word-level
  want: list[int] = []
  plain_differs = False      # the image's stream alone (greedy) would choose another token
  for _ in range(n):
    logits = []
    for inputs in streams:
      inputs = dict(inputs)
      extra = torch.tensor([want], dtype=inputs["input_ids"].dtype)
      for k in ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids"):
        if k in inputs:
          fill = extra if k == "input_ids" else (torch.ones_like(extra) if k == "attention_mask"
                                                 else torch.zeros_like(extra))
          inputs[k] = torch.cat([inputs[k], fill], dim=1)
      with torch.no_grad():
        logits.append(model(**inputs, use_cache=False).logits[0, -1].double().numpy())
    want.append(int(np.argmax((1 + alpha) * logits[0] - alpha * logits[1])))
    plain_differs |= int(np.argmax(logits[0])) != want[-1]
  assert g.output_ids == want
  # the contrast matters: plain greedy decoding of the image's stream follows `want` up to the
  # first step whose own argmax is another token, and takes that token there
  assert plain_differs
