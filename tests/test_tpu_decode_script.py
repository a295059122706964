"""benchmarks/tpu_decode.py on the CPU, run exactly as its docstring's CPU command says (a tiny
model, few tokens): every row's figures agree with each other and with what they count — the
tokens made are batch x new tokens (serving: the max_tokens asked), the roofline's bytes are the
parameters' bytes as held (the parameter count x 2 for bfloat16; fewer with int8) less the
input embedding's rows other than the batch's tokens' plus the KV cache's (layers x K and V x rows x cache length x kv heads x head dim x 4 bytes), over the
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


def docstring_command(int8_only: bool = False) -> list[str]:
  """The docstring's CPU command (with --int8-only: the one that has it)."""
  with open(os.path.join(ROOT, "benchmarks", "tpu_decode.py"), encoding="utf-8") as f:
    text = f.read()
  found = [shlex.split(m.group(1).replace("\\\\\n", " ")) for m in re.finditer(
      r"^ *(\.venv/bin/python benchmarks/tpu_decode\.py(?:.*\\\\\n)*.*)$", text, re.M)]
  argv = next((a for a in found if ("--int8-only" in a) == int8_only), None)
  assert argv, "the docstring's CPU command"
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
    # the input embedding (untied: not the head) is gathered: the batch's rows of it are read
    assert not mcfg.tie_word_embeddings
    table = mcfg.vocab_size * mcfg.emb_dim * 2     # bfloat16, in the int8 model too
    assert r["read_bytes"] == r["params_bytes"] - table + batch * mcfg.emb_dim * 2
    assert r["bytes_per_step"] == r["read_bytes"] + r["kv_bytes"]
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


@pytest.mark.timeout(900)
def test_the_int8_only_command_makes_the_int8_model_and_decodes(tmp_path, monkeypatch):
  """The docstring's --int8-only command (Gemma 4 tiny), in this process: the parameters it makes
  array by array are the int8 model's — against the model's own float init (`init_params`): the
  arrays it does not draw are the init's, bit for bit; each drawn array's spread is the init's;
  each quantized matrix is RTN's (every group's largest level is +-127) — its tables larger than
  a draw (CHUNK, made small here) written whole in pieces; then the rows: batch x new tokens, the
  roofline reading of the per-layer input table only the batch's rows (no --ttft: the other
  test's)."""
  import numpy as np

  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  import int8_init
  import tpu_decode
  from MaxText.models.registry import init_params

  made = {}

  def spy(mcfg, seed=0, layers=True):
    assert layers                      # decode_unroll_layers (base.yml's): per layer
    made["mcfg"] = mcfg
    made["params"], made["count"] = real(mcfg, seed, layers)
    return made["params"], made["count"]

  real = int8_init.params
  monkeypatch.setattr(int8_init, "params", spy)
  monkeypatch.setattr(int8_init, "CHUNK", 1 << 14)   # the two vocabulary tables: in pieces
  monkeypatch.setenv("HOME", tool_home(tmp_path))      # base.yml's cache: the suite's
  argv = docstring_command(int8_only=True)
  out = tmp_path / "rows.json"
  assert tpu_decode.main([*argv[2:], "--out", str(out)]) == 0
  rows = json.loads(out.read_text())

  mcfg = made["mcfg"]
  assert (mcfg.decoder_block, mcfg.weight_bits, mcfg.per_layer_input_dim) == ("gemma4", 8, 8)
  ours = flat(made["params"])
  init = flat(init_params(int8_init.per_layer(mcfg, weight_bits=0, weight_dtype="float32"), 0))
  assert made["count"] == sum(v.size for v in init.values())
  quantized = [k for k in ours if k.endswith("_scale")]
  assert len(quantized) >= 5 * mcfg.num_decoder_layers   # q, o, gate, up, down (+ k, v)
  for name, w in init.items():
    if name + "_scale" in ours:            # int8 levels, RTN scales per group of rows
      q, scale = ours[name], ours[name + "_scale"]
      assert q.dtype == np.int8 and q.shape == w.shape
      k = int(np.prod(q.shape)) // int(np.prod(scale.shape[1:]))
      groups = np.abs(q.astype(np.int32).reshape(scale.shape[0], k // scale.shape[0], -1))
      assert (groups.max(axis=1) == 127).all()
      deq = (q.astype(np.float32).reshape(scale.shape[0], k // scale.shape[0], -1)
             * scale.reshape(scale.shape[0], 1, -1))
      assert deq.std() == pytest.approx(w.std(), rel=0.25), name
    elif np.all(w == w.flat[0]):           # not drawn (norm scales): the init's values
      assert np.array_equal(ours[name].astype(np.float32), w), name
    else:                                  # drawn: the init's spread
      assert ours[name].shape == w.shape
      assert ours[name].astype(np.float32).std() == pytest.approx(w.std(), rel=0.25), name
  for table in ("embedding", "ple_embedding"):   # larger than a draw: every row written
    assert ours[table].size > int8_init.CHUNK
    assert (np.abs(ours[table].astype(np.float32)).sum(axis=1) > 0).all()

  model = next(r for r in rows if r["kind"] == "model")
  assert (model["weights"], model["per_layer"], model["platform"]) == ("int8", True, "cpu")
  assert model["params_bytes"] == sum(v.nbytes for v in ours.values())
  get = lambda flag: int(argv[argv.index(flag) + 1])
  batch, new = get("--batches"), get("--new")
  decode = [r for r in rows if r["kind"] == "decode"]
  assert [(r["weights"], r["batch"], r["tokens"]) for r in decode] == [("int8", batch, batch * new)]
  # the tied embedding is the head (read whole); of the per-layer input table, the batch's rows
  ple = ours["ple_embedding"]
  assert decode[0]["read_bytes"] == (model["params_bytes"] - ple.nbytes
                                     + batch * ple.nbytes // ple.shape[0])
  assert decode[0]["warm_s"] > decode[0]["compile_s"]   # compiled in its thread, before the row
  assert not any(r["kind"] in ("ttft", "serve", "error") for r in rows)


def flat(tree) -> dict:
  """{"a/b/c": NumPy array} of a parameter tree."""
  import jax
  import numpy as np
  from flax import traverse_util
  return {"/".join(map(str, k)): np.asarray(jax.device_get(v))
          for k, v in traverse_util.flatten_dict(tree).items()}
