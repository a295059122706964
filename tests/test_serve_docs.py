"""docs/decoding.md's serving recipe, as written there: its first command starts the server (on a
tiny checkpoint in place of the page's runs/tiny/checkpoints, a free port in place of 8000) and
the client snippet under it runs against it unchanged but for that address — the model's name and
the key agree (a 404 or 401 raises in the snippet). The cache of a model whose position limit is
8192 defaults to 2048 positions per slot; without `serve_model_name` a run's checkpoints are served
under the run's name."""
import contextlib
import io
import types

import jax
import pytest

openai = pytest.importorskip("openai")
requests = pytest.importorskip("requests")

from conftest import CACHE_DIR, MESH_1, train  # noqa: E402
from docs_blocks import blocks, commands, page, split_command  # noqa: E402
from MaxText.serve.__main__ import DEFAULT_ROOM, model_name  # noqa: E402
from test_serve import Server  # noqa: E402

DOCS_URL = "http://127.0.0.1:8000"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  out = tmp_path_factory.mktemp("serve_docs")
  code, _, _ = train(out, "tiny", "steps=2", "checkpoint_period=2", *MESH_1,
                     devices=jax.devices()[:1])
  assert code == 0
  return str(out / "tiny" / "checkpoints")


def test_the_docs_serve_command_and_its_client_snippet_agree(checkpoint):
  section = blocks(page("decoding.md"), "Serving")
  (_, shell), (lang, snippet) = section[:2]
  assert lang == "python"
  [command] = commands(shell)
  env, words = split_command(command)
  assert words[:4] == [".venv/bin/python", "-m", "MaxText.serve", "configs/base.yml"]
  assert "load_parameters_path=runs/tiny/checkpoints" in words and DOCS_URL in snippet
  args = [w.replace("runs/tiny/checkpoints", checkpoint) for w in words[4:]]
  server = Server([*args, "port=0", f"jax_cache_dir={CACHE_DIR}"],
                  env_key=env.get("MAXTEXT_API_KEY", ""))
  try:
    out = io.StringIO()
    namespace: dict = {}
    with contextlib.redirect_stdout(out):
      exec(compile(snippet.replace(DOCS_URL, server.url), "docs/decoding.md", "exec"), namespace)  # noqa: S102
    r = namespace["r"]
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens > 0
    assert out.getvalue().startswith(r.choices[0].text)
    assert len(out.getvalue()) > len(r.choices[0].text)      # the stream printed after it
    models = requests.get(server.url + "/v1/models",
                          headers={"Authorization": f"Bearer {env['MAXTEXT_API_KEY']}"}, timeout=60)
    [model] = models.json()["data"]
    assert model["id"] == "my-model" and model["max_model_len"] == DEFAULT_ROOM == 2048
    assert f"slots of {DEFAULT_ROOM} positions" in server.log()
  finally:
    code = server.stop()
  assert code == 0, server.log()[-3000:]


def test_the_default_model_name_is_the_runs():
  cfg = lambda **kw: types.SimpleNamespace(**{"serve_model_name": "", "hf_path": "",
                                              "load_parameters_path": "", **kw})
  assert model_name(cfg(load_parameters_path="runs/tiny/checkpoints")) == "tiny"
  assert model_name(cfg(load_parameters_path="runs/tiny/checkpoints/20/")) == "tiny"
  assert model_name(cfg(load_parameters_path="/w/q8")) == "q8"
  assert model_name(cfg(load_parameters_path="checkpoints")) == "checkpoints"
  assert model_name(cfg(hf_path="/models/Qwen3-0.6B")) == "Qwen3-0.6B"
  assert model_name(cfg(hf_path="/m/checkpoints")) == "checkpoints"
  assert model_name(cfg(serve_model_name="x", load_parameters_path="runs/a/checkpoints")) == "x"
  assert model_name(cfg()) == "maxtext"
