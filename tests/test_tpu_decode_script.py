"""benchmarks/tpu_decode.py on the CPU, run exactly as its docstring's CPU command says (a tiny
model, few tokens): every row's figures agree with each other and with what they count — the
tokens made are batch x new tokens (serving: the max_tokens asked), the roofline's bytes are the
parameters' bytes as held (the parameter count x 2 for bfloat16; fewer with int8) plus the KV
cache's (layers x K and V x rows x cache length x kv heads x head dim x 4 bytes), over the
bandwidth; the Markdown tables follow the JSON rows."""
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from conftest import BASE_YML, ROOT, tool_home
from MaxText.config.load import load_config
from MaxText.models.model_config import ModelConfig


def docstring_command() -> list[str]:
  with open(os.path.join(ROOT, "benchmarks", "tpu_decode.py"), encoding="utf-8") as f:
    text = f.read()
  m = re.search(r"^ *(\.venv/bin/python benchmarks/tpu_decode\.py(?:.*\\\\\n)*.*)$", text, re.M)
  assert m, "the docstring's CPU command"
  argv = shlex.split(m.group(1).replace("\\\\\n", " "))
  assert argv[0] == ".venv/bin/python"
  return [sys.executable, *argv[1:]]


@pytest.mark.timeout(1200)
def test_the_docstring_command_runs_and_its_rows_agree(tmp_path):
  out = tmp_path / "rows.json"
  argv = docstring_command()
  proc = subprocess.run([*argv, "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                        env={**os.environ, "JAX_PLATFORMS": "cpu", "HOME": tool_home(tmp_path)},
                        check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  printed = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
  rows = json.loads(out.read_text())
  assert printed == rows
  assert "| weights | batch | tokens/s |" in proc.stdout and "| clients |" in proc.stdout
  get = lambda flag: argv[argv.index(flag) + 1]
  batch, prompt, new = int(get("--batches")), int(get("--prompt")), int(get("--new"))
  keys = argv[argv.index("--set") + 1:]
  mcfg = ModelConfig.from_config(load_config([BASE_YML, *keys]))

  models = [r for r in rows if r["kind"] == "model"]
  assert [m["weights"] for m in models] == ["bfloat16", "int8"]
  assert models[0]["per_layer"] and models[0]["platform"] == "cpu"
  assert models[0]["params_bytes"] == 2 * models[0]["parameters"]
  assert models[1]["params_bytes"] < models[0]["params_bytes"]
  held = {m["weights"]: m["params_bytes"] for m in models}

  decode = [r for r in rows if r["kind"] == "decode"]
  assert [(r["weights"], r["batch"]) for r in decode] == [("bfloat16", batch), ("int8", batch)]
  cache_length = 64   # prompt + new rounded up to the cache's bucket (>= 64)
  kv = (mcfg.num_decoder_layers * 2 * batch * cache_length * mcfg.num_kv_heads * mcfg.head_dim
        * 4)   # float32 cache on a CPU
  for r in decode:
    assert r["tokens"] == batch * new and (r["prompt"], r["new"]) == (prompt, new)
    assert r["cache_length"] == cache_length and r["kv_bytes"] == kv
    assert r["params_bytes"] == held[r["weights"]]
    assert r["bytes_per_step"] == r["params_bytes"] + r["kv_bytes"]
    assert r["roofline_ms"] == pytest.approx(r["bytes_per_step"] / r["bandwidth"] * 1e3)
    assert r["roofline_tokens_per_s"] == pytest.approx(batch / r["roofline_ms"] * 1e3)
    assert r["tokens_per_s"] == pytest.approx(batch / r["ms_per_step"] * 1e3)
    assert r["share"] == pytest.approx(r["roofline_ms"] / r["ms_per_step"])
    assert r["bandwidth"] == 819e9

  ttft = [r for r in rows if r["kind"] == "ttft"]
  assert [(r["prompt"], r["status"], r["tokens"]) for r in ttft] == [(int(get("--ttft")), "ok", 1)]
  assert ttft[0]["ttft_ms"] > 0

  serve = [r for r in rows if r["kind"] == "serve"]
  clients = int(get("--clients"))
  assert [(r["clients"], r["step_between_pieces"]) for r in serve] == \
      [(clients, False), (int(get("--interleave")), True)]
  for s in serve:
    assert s["requests"] == clients * int(get("--requests")) == len(s["solo_latency_s"])
    assert s["tokens"] == s["tokens_asked"] and s["finished"] == ["length"]
    assert 0 < s["latency_over_solo_median"] <= s["latency_over_solo_max"]
    assert s["tokens_per_s"] == pytest.approx(s["tokens"] / s["wall_s"])
    # Slots.warm: every row bucket (1, 2: --slots 2, serve_min_rows 1) x cache window
    assert s["slots_min_rows"] == 1 and s["warm_programs"] == 2 * len(s["windows"])
    assert s["prefill_chunk"] == 8 < int(get("--request-prompt").split(",")[1])   # pieces
