"""`python -m MaxText.serve` as a user meets it: a real server process on 127.0.0.1 (a free port,
an API key), started and stopped here, on the tiny random Llama of tests/test_lmeval.py (fp32,
one device, 4 slots, so 16 requests share them), talked to by the official `openai` client.

Oracles: `MaxText.inference` (what `python -m MaxText.decode` runs) on the same weights in this
process — greedy text and per-token log-probabilities, sampled texts for the same seed (the
server's choice i is decode's prompt i), teacher-forced scores for echo; and lm-eval's own `hf`
model against lm-eval's `local-completions` talking to the server (per item the same
log-likelihoods within 1e-4, the same is_greedy, accuracies, generations). Streams concatenate to
the whole answer; a stream dropped midway frees its slot; 100 malformed requests get their 4xx
naming the field and the server then still answers; without or with a wrong key: 401; SIGTERM
with a request in flight: it is answered, the process exits 0."""
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

openai = pytest.importorskip("openai")
requests = pytest.importorskip("requests")
pytest.importorskip("lm_eval")

from conftest import BASE_YML, CACHE_DIR, MESH_1, ROOT, xla_flags  # noqa: E402
from test_lmeval import (MAX_LENGTH, PROMPTS, QUESTIONS, TEMPLATE, evaluate,  # noqa: E402,F401
                         hf_args, per_item, setup)

KEY = "test-key-7c1e"
NAME = "tiny"
SLOTS = 4
ROOM = 128
QUEUE = 20
# the tiny template with the variables a request can set: tools and a chat_template_kwargs value
TOOLS_TEMPLATE = ("{% if tools %}[tools: {% for t in tools %}{{ t['function']['name'] }} "
                  "{% endfor %}] {% endif %}{% if hint %}[hint: {{ hint }}] {% endif %}" + TEMPLATE)
LONG = "The quick brown fox jumps over the lazy dog. " * 2


@pytest.fixture(scope="module")
def folder(setup, tmp_path_factory):  # noqa: F811  (the fixture imported above)
  """The tiny Hugging Face folder with a chat template that reads tools and `hint`."""
  path = str(tmp_path_factory.mktemp("serve") / "hf")
  shutil.copytree(setup[0], path)
  with open(os.path.join(path, "chat_template.jinja"), "w", encoding="utf-8") as f:
    f.write(TOOLS_TEMPLATE)
  return path


def config_args(folder):
  return [f"hf_path={folder}", "dtype=float32", *MESH_1, f"max_cache_length={ROOM}"]


@pytest.fixture(scope="module")
def ours(folder):
  """What MaxText.decode runs, on the same weights (one device)."""
  from MaxText import inference
  return inference.load([BASE_YML, *config_args(folder)], jax.devices()[:1])


class Server:
  """The server process; its stderr read on a thread (the first line names its address)."""

  def __init__(self, args, env_key=KEY):
    env = {**os.environ, "XLA_FLAGS": xla_flags(1),
           "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT, "MAXTEXT_API_KEY": env_key}
    self.proc = subprocess.Popen([sys.executable, "-m", "MaxText.serve", BASE_YML, *args],
                                 cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
    self.lines: list[str] = []
    self.url: str | None = None
    ready = threading.Event()

    def read():
      assert self.proc.stdout is not None
      for line in self.proc.stdout:
        self.lines.append(line)
        found = re.search(r"serving \S+ on (http://127\.0\.0\.1:\d+)", line)
        if found:
          self.url = found.group(1)
          ready.set()
      ready.set()
    self.reader = threading.Thread(target=read, daemon=True)
    self.reader.start()
    ready.wait()
    assert self.url, "".join(self.lines)

  def log(self) -> str:
    return "".join(self.lines)

  def stop(self) -> int:
    if self.proc.poll() is None:
      self.proc.send_signal(signal.SIGTERM)
    code = self.proc.wait(120)
    self.reader.join(10)
    return code


@pytest.fixture(scope="module")
def server(folder):
  s = Server([*config_args(folder), "port=0", f"serve_slots={SLOTS}", f"serve_model_name={NAME}",
              "serve_chunk=4", "serve_max_tokens=2000", f"serve_queue={QUEUE}", "serve_max_body_bytes=100000",
              f"jax_cache_dir={CACHE_DIR}"])
  yield s
  if s.proc.poll() is None:
    s.proc.kill()
    s.proc.wait()


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def no_eos(g):
  """A generation's tokens and log-probabilities without its eos (the API's text has none)."""
  n = len(g.output_ids) - (g.finish_reason == "eos")
  return g.output_ids[:n], g.output_logprobs[:n]


def test_greedy_completions_equal_decode_and_streams_concatenate(client, ours):
  prompts = [*PROMPTS, LONG]
  want = ours.generate(prompts, max_new_tokens=24, temperature=0.0)
  r = client.completions.create(model=NAME, prompt=prompts, max_tokens=24, temperature=0,
                                logprobs=1)
  assert [c.index for c in r.choices] == list(range(len(prompts)))
  for c, g in zip(r.choices, want):
    ids, lps = no_eos(g)
    assert c.text == g.text and c.finish_reason == ("stop" if g.finish_reason == "eos" else
                                                    "length")
    assert c.logprobs.tokens == [ours.tokenizer.decode([t]) for t in ids]
    np.testing.assert_allclose(c.logprobs.token_logprobs, lps, atol=1e-5, rtol=0)
    # greedy: each token is the most likely there, its log-probability the top one's
    assert [max(top.values()) for top in c.logprobs.top_logprobs] == c.logprobs.token_logprobs
  assert r.usage.prompt_tokens == sum(len(g.prompt_ids) for g in want)
  assert r.usage.completion_tokens == sum(len(no_eos(g)[0]) for g in want)
  assert any(g.text for g in want)
  # token ids as the prompt: the same; streamed: the chunks concatenate to the whole text
  by_ids = client.completions.create(model=NAME, prompt=want[4].prompt_ids, max_tokens=24,
                                     temperature=0)
  assert by_ids.choices[0].text == want[4].text
  for p, g in zip(prompts, want):
    chunks = list(client.completions.create(model=NAME, prompt=p, max_tokens=24, temperature=0,
                                            stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == g.text
    assert chunks[-1].choices[0].finish_reason is not None


def test_stop_strings_end_the_text_before_them(client, ours):
  [g] = ours.generate([LONG], max_new_tokens=24, temperature=0.0)
  stop = g.text[5:7]
  assert len(stop) == 2 and g.text.index(stop) > 0
  whole = client.completions.create(model=NAME, prompt=LONG, max_tokens=24, temperature=0,
                                    stop=[stop, "never"])
  assert whole.choices[0].text == g.text[:g.text.index(stop)]
  assert whole.choices[0].finish_reason == "stop"
  streamed = client.completions.create(model=NAME, prompt=LONG, max_tokens=24, temperature=0,
                                       stop=[stop, "never"], stream=True)
  assert "".join(ch.choices[0].text for ch in streamed) == whole.choices[0].text


def test_sampled_choices_are_decodes_for_the_seed_and_reproducible(client, ours):
  kw = dict(temperature=0.9, top_k=40, top_p=0.95, min_p=0.02)
  want = ours.generate([PROMPTS[1]] * 3, max_new_tokens=12, seed=7, **kw)
  get = lambda: client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=12, n=3,
                                          seed=7, temperature=kw["temperature"],
                                          top_p=kw["top_p"],
                                          extra_body={"top_k": 40, "min_p": 0.02})
  first, again = get(), get()
  texts = [c.text for c in first.choices]
  assert texts == [c.text for c in again.choices] == [g.text for g in want]
  assert len(set(texts)) == 3
  other = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=12, n=3, seed=8,
                                    temperature=0.9)
  assert [c.text for c in other.choices] != texts


def test_echo_logprobs_score_the_prompt(client, ours):
  ids = ours.encode(QUESTIONS[1], chat=False) + ours.encode(" mat", chat=False)[1:]
  r = client.completions.create(model=NAME, prompt=ids, max_tokens=1, temperature=0, logprobs=1,
                                echo=True)
  lp = r.choices[0].logprobs
  assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
  assert len(lp.token_logprobs) == len(ids) + 1
  [want] = ours.score([ids[:1]], [ids[1:]])
  np.testing.assert_allclose(lp.token_logprobs[1:-1], want, atol=1e-5, rtol=0)
  assert r.choices[0].text.startswith(ours.text(ids))


def test_chat_completions_render_the_template_with_tools_and_kwargs(client, ours):
  messages = [{"role": "user", "content": "Hello"}]
  tools = [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]
  plain = ours.render_chat(messages)
  ids = ours.render_chat(messages, tools, {"hint": "be brief"})
  assert len(ids) > len(plain)
  for prompt, extra in ((plain, {}), (ids, {"tools": tools,
                                            "extra_body": {"chat_template_kwargs":
                                                           {"hint": "be brief"}}})):
    [g] = ours.generate([prompt], max_new_tokens=16, temperature=0.0)
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=16,
                                       temperature=0, logprobs=True, top_logprobs=2, **extra)
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content == g.text
    assert r.usage.prompt_tokens == len(prompt)
    np.testing.assert_allclose([t.logprob for t in c.logprobs.content], no_eos(g)[1], atol=1e-5)
    assert all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=16,
                                                 temperature=0, stream=True, **extra))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == g.text


def test_16_concurrent_requests_of_different_lengths(server, ours):
  prompts = [(PROMPTS + QUESTIONS + [LONG])[i % 9] + "xyz"[: i % 4] for i in range(16)]
  lengths = [1 + (5 * i) % 23 for i in range(16)]
  want = {}
  for n in set(lengths):
    idx = [i for i in range(16) if lengths[i] == n]
    for i, g in zip(idx, ours.generate([prompts[i] for i in idx], max_new_tokens=n,
                                       temperature=0.0)):
      want[i] = g.text

  async def all_of_them():
    c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    async def one(i):
      r = await c.completions.create(model=NAME, prompt=prompts[i], max_tokens=lengths[i],
                                     temperature=0, stream=i % 2 == 1)
      if i % 2:
        return "".join([ch.choices[0].text async for ch in r])
      return r.choices[0].text
    try:
      return await asyncio.gather(*(one(i) for i in range(16)))
    finally:
      await c.close()
  assert asyncio.run(all_of_them()) == [want[i] for i in range(16)]
  metrics = requests.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
  assert metrics.status_code == 200
  assert re.search(r"^maxtext_slots_busy 0\.0$", metrics.text, re.M), metrics.text
  assert re.search(r'^maxtext_requests_total\{endpoint="/v1/completions",status="200"\} '
                   r'(\d+)', metrics.text, re.M)
  assert "maxtext_time_to_first_token_seconds_count" in metrics.text


def generated(server) -> float:
  text = requests.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
  return float(re.search(r"^maxtext_generated_tokens_total (\S+)$", text, re.M).group(1))


def wait_idle(server) -> dict:
  """/health once no slot is busy and nothing waits (polled: the engine frees a slot between
  its decoding calls)."""
  for _ in range(600):
    h = requests.get(server.url + "/health", headers={"Authorization": f"Bearer {KEY}"}).json()
    if h["slots_busy"] == 0 and h["queue"] == 0:
      return h
    time.sleep(0.05)
  raise AssertionError(f"slots still busy: {h}")


def runs_long(ours, n: int):
  """(a short prompt whose greedy completion runs `n` tokens without an eos, that completion)."""
  candidates = [*PROMPTS, *QUESTIONS, "abc" * 3, "zz", "Hello there", "x = 1"]
  for p, g in zip(candidates, ours.generate(candidates, max_new_tokens=n, temperature=0.0)):
    if g.finish_reason == "length":
      return p, g
  raise AssertionError("every candidate meets an eos")


def test_a_dropped_stream_frees_its_slot(client, server, ours):
  prompt, g = runs_long(ours, 100)              # it would run all 100 tokens
  wait_idle(server)
  before = generated(server)
  stream = client.completions.create(model=NAME, prompt=prompt, max_tokens=100, temperature=0,
                                     stream=True)
  got = ""
  for chunk in stream:
    got += chunk.choices[0].text
    if len(got) >= 3:
      break
  stream.close()
  wait_idle(server)
  assert g.text.startswith(got)
  assert generated(server) - before < 100       # cancelled before its end
  # the slots still serve
  r = client.completions.create(model=NAME, prompt=prompt, max_tokens=100, temperature=0)
  assert r.choices[0].text == g.text


def malformed(url):
  """(method, path, body or raw bytes, headers, the status, the field named): 100 requests."""
  good = {"model": NAME, "prompt": "abc", "max_tokens": 4}
  chat = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
  cases = []
  for body in (b"{", b"not json", b"[1, 2", b'{"model": "tiny",}', b"\xff\xfe"):
    cases.append(("/v1/completions", body, 400, "body"))
    cases.append(("/v1/chat/completions", body, 400, "body"))
  wrong_types = {"model": [1, None, ["tiny"]], "prompt": [None, 5, {"a": 1}, [1.5], [[1, "a"]]],
                 "max_tokens": ["many", -1, 1.5, [4]], "temperature": ["hot", -0.5, None],
                 "top_p": [0, 1.5, "x"], "top_k": [-2, "x"], "min_p": [-0.1, 2], "n": [0, "x"],
                 "stop": [5, [1, 2]], "seed": ["x", 1.5], "logprobs": [-1, 21, "x"],
                 "echo": ["maybe", [1]], "stream": ["x"], "stream_options": [{"x": 1}]}
  for name, values in wrong_types.items():
    for v in values:
      cases.append(("/v1/completions", {**good, name: v}, 422, name))
  for name, v in (("messages", []), ("messages", "hi"), ("messages", [{"content": "x"}]),
                  ("top_logprobs", 50), ("logprobs", "x"), ("tools", "x"),
                  ("chat_template_kwargs", [1]), ("max_completion_tokens", 0),
                  ("max_tokens", "x"), ("n", -1)):
    cases.append(("/v1/chat/completions", {**chat, name: v}, 422, name))
  for name, values in {"temperature": ["x", -1], "top_p": [2], "stop": [3], "seed": ["s"],
                       "stream": [[1]], "tool_choice": [5],
                       "messages": [[{"role": 5, "content": "x"}],
                                    [{"role": "user", "content": 5}]]}.items():
    for v in values:
      cases.append(("/v1/chat/completions", {**chat, name: v}, 422, name))
  for body in (b"[]", b"1", b'"x"', b"null"):
    cases.append(("/v1/completions", body, 422, "body"))
    cases.append(("/v1/chat/completions", body, 422, "body"))
  cases.append(("/v1/completions", {"prompt": "abc"}, 422, "model"))
  cases.append(("/v1/chat/completions", {"model": NAME}, 422, "messages"))
  for name in ("best_of", "logit_bias", "suffix", "foo"):
    cases.append(("/v1/completions", {**good, name: 1}, 422, name))
  for name in ("functions", "bar"):
    cases.append(("/v1/chat/completions", {**chat, name: 1}, 422, name))
  cases += [
      ("/v1/completions", {**good, "model": "other"}, 404, "model"),
      ("/v1/chat/completions", {**chat, "model": "other"}, 404, "model"),
      ("/v1/completions", {**good, "max_tokens": ROOM}, 400, "max_tokens"),
      ("/v1/completions", {**good, "max_tokens": 100, "n": 21}, 400, "max_tokens"),
      ("/v1/completions", {**good, "max_tokens": 1, "n": QUEUE + 1}, 400, "n"),
      ("/v1/completions", {**good, "prompt": "x" * (ROOM + 5)}, 400, "prompt"),
      ("/v1/completions", {**good, "prompt": ""}, 400, "prompt"),
      ("/v1/completions", {**good, "prompt": []}, 400, "prompt"),
      ("/v1/completions", {**good, "prompt": [1, 99999]}, 400, "prompt"),
      ("/v1/completions", {**good, "prompt": [[1, 5], [-3]]}, 400, "prompt"),
      ("/v1/completions", {**good, "max_tokens": 0}, 400, "max_tokens"),
      ("/v1/completions", {**good, "presence_penalty": 0.5}, 400, "presence_penalty"),
      ("/v1/chat/completions", {**chat, "frequency_penalty": 1}, 400, "frequency_penalty"),
      ("/v1/chat/completions", {**chat, "max_tokens": ROOM}, 400, "max_tokens"),
      ("/v1/chat/completions", {**chat, "chat_template_kwargs": {"messages": 1}}, 400,
       "chat_template_kwargs.messages"),
      ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": [
          {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]}, 400,
       "messages[0].content[0].image_url.url"),
      ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": [
          {"type": "image_url", "image_url": {"url": "/etc/passwd"}}]}]}, 400,
       "messages[0].content[0].image_url.url"),
      ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": [
          {"type": "text", "text": 5}]}]}, 400, "messages[0].content[0].text"),
      ("/v1/completions", {**good, "prompt": "y" * 120000}, 413, None),
      ("/v1/nothing", good, 404, "path"),
  ]
  return cases


def test_malformed_requests_get_their_4xx_and_the_server_keeps_serving(server, client, ours):
  cases = malformed(server.url)
  assert len(cases) == 100
  headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
  for path, body, status, field in cases:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = requests.post(server.url + path, data=data, headers=headers)
    assert r.status_code == status, (path, body if len(data) < 300 else len(data), r.text)
    error = r.json()["error"]
    if field is not None:
      assert error["param"] == field or field in error["message"], (body, error)
    assert "Traceback" not in r.text
  assert requests.get(server.url + "/v1/completions", headers=headers).status_code == 405
  [g] = ours.generate([PROMPTS[0]], max_new_tokens=8, temperature=0.0)
  r = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0)
  assert r.choices[0].text == g.text
  assert server.proc.poll() is None and "Traceback" not in server.log()


def test_a_full_queue_answers_503_with_retry_after(client, ours):
  """4 slots busy with 4 of a request's 20 choices, its other 16 waiting: a request of 5 more
  does not fit the queue of 20 (503, Retry-After); the first is still answered whole."""
  stream = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=100, n=QUEUE,
                                     temperature=0, stream=True)
  it = iter(stream)
  first = next(it)                   # its first 4 choices hold the slots, 16 wait
  with pytest.raises(openai.APIStatusError) as e:
    client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=4, n=5, temperature=0)
  assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"
  assert "serve_queue" in e.value.message
  texts = [""] * QUEUE
  for chunk in [first, *it]:
    texts[chunk.choices[0].index] += chunk.choices[0].text
  [g] = ours.generate([PROMPTS[2]], max_new_tokens=100, temperature=0.0)
  assert texts == [g.text] * QUEUE


def test_the_key_is_needed(server):
  for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                  {"Authorization": f"Bearer {KEY}x"}):
    for path in ("/v1/models", "/health", "/metrics"):
      r = requests.get(server.url + path, headers=headers)
      assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", path
    r = requests.post(server.url + "/v1/completions", headers=headers,
                      json={"model": NAME, "prompt": "abc"})
    assert r.status_code == 401
  bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
  with pytest.raises(openai.AuthenticationError):
    bad.models.list()
  good = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
  assert [m.id for m in good.models.list()] == [NAME]
  assert KEY not in server.log() and PROMPTS[0] not in server.log()


@pytest.fixture(scope="module")
def hf_results(setup):  # noqa: F811
  """lm-eval's hf model on the two tasks the server is compared on."""
  return evaluate("hf", setup[2], ("tiny_mc", "tiny_gen"), model_args=hf_args(setup), batch_size=1)


def test_lm_eval_local_completions_equals_hf(server, setup, hf_results,  # noqa: F811
                                              monkeypatch):
  monkeypatch.setenv("OPENAI_API_KEY", KEY)
  got = evaluate("local-completions", setup[2], ("tiny_mc", "tiny_gen"), model_args={
      "base_url": server.url + "/v1/completions", "model": NAME, "tokenizer": setup[0],
      "tokenizer_backend": "huggingface", "tokenized_requests": True, "add_bos_token": True,
      "max_length": MAX_LENGTH + 1, "max_gen_toks": 12, "num_concurrent": 1,
      "max_retries": 1, "batch_size": 4})
  want_mc, got_mc = per_item(hf_results, "tiny_mc"), per_item(got, "tiny_mc")
  assert len(got_mc) == len(QUESTIONS)
  for w, g in zip(want_mc, got_mc):
    (w_ll, w_greedy), (g_ll, g_greedy) = (np.array(x["filtered_resps"], dtype=object).T
                                          for x in (w, g))
    np.testing.assert_allclose(g_ll.astype(float), w_ll.astype(float), atol=1e-4, rtol=0)
    assert list(g_greedy) == list(w_greedy)
    assert (g["acc"], g["acc_norm"]) == (w["acc"], w["acc_norm"])
  assert sum(sum(np.array(s["filtered_resps"], dtype=object).T[1]) for s in want_mc) >= 1
  want_gen = [s["filtered_resps"][0] for s in per_item(hf_results, "tiny_gen")]
  assert [s["filtered_resps"][0] for s in per_item(got, "tiny_gen")] == want_gen
  assert any(want_gen)


def test_lm_eval_local_chat_completions_gives_hf_chat_generations(server, setup, monkeypatch):  # noqa: F811
  """--apply_chat_template: the server renders the messages with the tokenizer's template (no
  tools, no hint: the tiny template's text) as lm-eval's hf model renders them."""
  monkeypatch.setenv("OPENAI_API_KEY", KEY)
  # max_length: lm-eval's hf model would cut the rendered prompt to max_length - max_gen_toks
  # tokens; the chat API has no such cut (the server takes the whole conversation)
  want = evaluate("hf", setup[2], ("tiny_gen",), model_args={**hf_args(setup), "max_length": ROOM},
                  batch_size=1, apply_chat_template=True)
  got = evaluate("local-chat-completions", setup[2], ("tiny_gen",), apply_chat_template=True,
                 model_args={"base_url": server.url + "/v1/chat/completions", "model": NAME,
                             "max_gen_toks": 12, "max_retries": 1})
  texts = lambda r: [s["filtered_resps"][0] for s in per_item(r, "tiny_gen")]
  assert texts(got) == texts(want) and any(texts(want))


def test_sigterm_answers_the_request_in_flight_then_exits_0(server, client, ours):
  """Last: it stops the module's server."""
  prompt, g = runs_long(ours, 60)
  stream = client.completions.create(model=NAME, prompt=prompt, max_tokens=60, temperature=0,
                                     stream=True)
  it = iter(stream)
  text = next(it).choices[0].text
  server.proc.send_signal(signal.SIGTERM)
  for chunk in it:
    text += chunk.choices[0].text
  assert text == g.text
  assert server.stop() == 0
  log = server.log()
  assert "Traceback" not in log, log
  # where the start-up went, and the first request's seconds with the programs compiled for it
  assert re.search(r"start-up [\d.]+ s to listening: imports [\d.]+ \| config [\d.]+ \| "
                   r"model [\d.]+ \| app [\d.]+\n", log), log
  assert len(re.findall(r"first answer [\d.]+ s after its request arrived \((compile [\d.]+ s: "
                        r"\d+ programs?, \d+ from the cache|no compile)\)", log)) == 1, log
