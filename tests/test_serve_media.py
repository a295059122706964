"""Images and audio through the OpenAI-compatible server (MaxText/serve/media.py): a tiny random
Gemma 4 with its vision and audio towers and its processor's files (tests/test_multimodal_inputs),
the application in this process (FastAPI's test client; its engine thread and slots as
`python -m MaxText.serve` builds them).

Oracle: `MaxText.inference` on the same folder, the same image and clip read from files — the
chat completion with them as base64 data URLs (`image_url`, `input_audio`) answers greedy
`generate`'s text with its per-token log-probabilities. A path, a `file://` or `http://` URL, a
data URL that is not base64 or not an image / a WAV file is refused with 400 naming the field, and
nothing is opened."""
import base64
import builtins
import io
import os
import sys
from contextlib import asynccontextmanager

import jax
import numpy as np
import pytest

pytest.importorskip("fastapi")

sys.path.insert(0, os.path.dirname(__file__))
from conftest import BASE_YML  # noqa: E402
from test_gemma4_mm_audio import hf_model  # noqa: E402
from test_multimodal_inputs import save_with_processor, write_wav  # noqa: E402

ROOM = 256
TOL_LOGPROB = 5e-5


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  """(the image and clip files, the oracle model, a test client of the running application)."""
  import PIL.Image
  from fastapi.testclient import TestClient

  from MaxText import inference
  from MaxText.decoding.slots import Slots
  from MaxText.serve.app import Served, build_app, running
  from MaxText.serve.metrics import Metrics
  from MaxText.serve.scheduler import Scheduler
  from MaxText.serve.text import TextStream
  d = tmp_path_factory.mktemp("serve_media")
  save_with_processor(hf_model(), d / "hf",
                      image=dict(patch_size=2, max_soft_tokens=70, pooling_kernel_size=2),
                      audio=dict(feature_size=128))
  rng = np.random.default_rng(0)
  PIL.Image.fromarray(rng.integers(0, 256, (30, 44, 3), dtype=np.uint8)).save(d / "img.png")
  write_wav(d / "clip.wav", (rng.standard_normal(6000) * 3000).astype(np.int16))
  model = inference.load([BASE_YML, f"hf_path={d / 'hf'}", "dtype=float32",
                          f"max_cache_length={ROOM}"], jax.devices()[:1])
  scheduler = Scheduler(model, Slots(model.engine, 2, ROOM, chunk=4), 8, None,
                        lambda stop: TextStream(model.text, stop), prefill_chunk=16)
  app = build_app(Served(model, scheduler, Metrics(), "mm", ROOM, 4096))

  @asynccontextmanager
  async def lifespan(_app):
    with running(scheduler):
      yield
  app.router.lifespan_context = lifespan
  with TestClient(app) as client:
    yield d, model, client


def b64(path) -> str:
  with open(path, "rb") as f:
    return base64.b64encode(f.read()).decode()


QUESTION = {"type": "text", "text": "what is this"}


def data_url_parts(d) -> list[dict]:
  """The image and the clip as base64 data URLs, then the question."""
  return [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(d / "img.png")}},
          {"type": "input_audio", "input_audio": {"data": b64(d / "clip.wav"), "format": "wav"}},
          QUESTION]


def test_an_image_and_a_clip_as_data_urls_answer_generates_text(served):
  d, model, client = served
  [want] = model.generate([{"messages": [{"role": "user", "content": [
      {"type": "image", "image": str(d / "img.png")}, {"type": "audio", "audio": str(d / "clip.wav")},
      QUESTION]}]}], max_new_tokens=8)
  r = client.post("/v1/chat/completions", json={
      "model": "mm", "max_tokens": 8, "temperature": 0, "logprobs": True,
      "messages": [{"role": "user", "content": data_url_parts(d)}]})
  assert r.status_code == 200, r.text
  choice = r.json()["choices"][0]
  assert choice["message"]["content"] == want.text
  got = [t["logprob"] for t in choice["logprobs"]["content"]]
  np.testing.assert_allclose(got, want.output_logprobs[:len(got)], atol=TOL_LOGPROB, rtol=0)
  assert r.json()["usage"]["prompt_tokens"] == len(want.prompt_ids)


def test_paths_and_urls_are_refused_and_never_opened(served, monkeypatch):
  d, _, client = served
  opened = []
  real_open = builtins.open
  monkeypatch.setattr(builtins, "open", lambda f, *a, **k: opened.append(f) or real_open(f, *a, **k))
  png = "data:image/png;base64," + b64(d / "img.png")
  wav = io.BytesIO()
  cases = [
      ({"type": "image_url", "image_url": {"url": f"file://{d / 'img.png'}"}}, "image_url.url"),
      ({"type": "image_url", "image_url": {"url": str(d / "img.png")}}, "image_url.url"),
      ({"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}, "image_url.url"),
      ({"type": "image_url", "image_url": str(d / "img.png")}, "image_url"),
      ({"type": "audio_url", "audio_url": {"url": f"file://{d / 'clip.wav'}"}}, "audio_url.url"),
      ({"type": "input_audio", "input_audio": {"data": str(d / "clip.wav"), "format": "wav"}},
       "input_audio.data"),
      ({"type": "input_audio", "input_audio": {"data": b64(d / "clip.wav"), "format": "mp3"}},
       "input_audio.format"),
      ({"type": "image_url", "image_url": {"url": "data:image/png,notbase64"}}, "image_url.url"),
      ({"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%"}}, "image_url.url"),
      ({"type": "image_url", "image_url": {"url": "data:image/png;base64," +
                                           base64.b64encode(b"not an image").decode()}},
       "image_url.url"),
      ({"type": "image_url", "image_url": {"url": png.replace("image/png", "text/plain")}},
       "image_url.url"),
      ({"type": "input_audio", "input_audio": {"data": base64.b64encode(wav.getvalue() + b"RIFF")
                                               .decode(), "format": "wav"}}, "input_audio.data"),
  ]
  opened.clear()
  for part, field in cases:
    r = client.post("/v1/chat/completions", json={
        "model": "mm", "max_tokens": 2, "messages": [{"role": "user", "content": [part]}]})
    assert r.status_code == 400, (part, r.text)
    assert r.json()["error"]["param"] == f"messages[0].content[0].{field}", (part, r.text)
  assert not [f for f in opened if str(f).endswith(("img.png", "clip.wav"))]   # named, never read
  # and the same data URLs still answer (the first test's request: a prompt with media prefills
  # whole, so another prompt length would compile another prefill for nothing new)
  r = client.post("/v1/chat/completions", json={
      "model": "mm", "max_tokens": 2, "temperature": 0,
      "messages": [{"role": "user", "content": data_url_parts(d)}]})
  assert r.status_code == 200, r.text
