"""Int8 vocabulary tables (`weight_quant_vocab`, MaxText/layers/quant_vocab.py): the tied head's
matmul on the int8 table equals x @ (levels x scale)^T of NumPy in float64 and the lookup gives the
dequantized rows bit for bit (XLA's gather and the TPU's row-gather kernel, interpreted); the
table's RTN is a NumPy one (one scale per row); the int8 model of
a tiny Gemma 4 (tied head, per-layer-input table) and of a tiny Qwen3 (untied head) computes the
float model's logits on the dequantized tables within float32 rounding and decodes its greedy
tokens; `python -m MaxText.quantize ... weight_quant_vocab=true` writes int8 tables that the decode
CLI reads and to_huggingface dequantizes; benchmarks/int8_init.py draws the int8 tables as the
quantized float tables it would draw, and `read_bytes` counts them."""
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, traverse_util

from conftest import BASE_YML, ROOT
from MaxText.config.load import load_config, replace
from MaxText.layers import quant, quant_vocab
from MaxText.models.model_config import ModelConfig
from MaxText.models.registry import init_params, make_model_def
from MaxText.quantization import convert

PROMPTS = [[1, 5, 9, 20, 31], [3, 7]]
NEW = 6


def _assert_rtn_rows(w, q, s):
  """q, s are RTN of table w with one scale per row, in NumPy (float32): s = max |w| / 127 (to one
  float32 ulp: XLA may multiply by 1/127), q = round(w / s) clipped to int8, every row's largest
  level +-127."""
  w = np.asarray(w, np.float32)
  assert q.dtype == np.int8 and q.shape == w.shape and s.shape == w.shape[:1]
  np.testing.assert_allclose(s, np.abs(w).max(axis=1) / np.float32(127), rtol=2.4e-7, atol=0)
  np.testing.assert_array_equal(q, np.clip(np.round(w / s[:, None]), -128, 127).astype(np.int8))
  assert (np.abs(q.astype(np.int32)).max(axis=1) == 127).all()


# ---- the table's two uses against NumPy --------------------------------------------------------
class _Owner(nnx.Module):
  def __init__(self, v, d):
    self.embedding = nnx.Param(jnp.zeros((v, d), jnp.float32), logical_axes=("vocab", "embed"))
    self.other = nnx.Param(jnp.zeros((d, v), jnp.float32), logical_axes=("embed", "vocab"))


@pytest.mark.parametrize("rows", [1, 12])
def test_int_table_lookup_and_head_equal_numpy(rows):
  """Rows of very different sizes (a per-row scale matters): `quantize_table` is NumPy's RTN per
  row; the head's matmul (fewer rows than MIN_ROWS padded) equals x @ (q s)^T in float64 to fp32
  rounding, and the lookup gives q s of the tokens' rows exactly."""
  rng = np.random.default_rng(rows)
  w = (rng.normal(size=(48, 32)) * rng.uniform(0.01, 3, size=(48, 1))).astype(np.float32)
  q, s, err = convert.quantize_table(w)
  _assert_rtn_rows(w, q, s)
  assert 0 < err < 1e-3
  owner = _Owner(48, 32)
  assert quant_vocab.tables(owner) == ["embedding"]            # a [V, D] table, not [D, V]
  assert quant_vocab.attach(_Owner(48, 32), "embed") == []      # weight_quant_exclude's regex
  assert quant_vocab.head_params(owner, "embedding") == (("embedding",),)
  assert quant_vocab.attach(owner, "") == ["embedding"]
  assert owner.embedding[...].dtype == jnp.int8
  assert quant_vocab.head_params(owner, "embedding") == (("embedding",), ("embedding_scale",))
  owner.embedding = nnx.Param(jnp.asarray(q), logical_axes=("vocab", "embed"))
  owner.embedding_scale = nnx.Param(jnp.asarray(s), logical_axes=("vocab",))
  deq = q.astype(np.float64) * s[:, None].astype(np.float64)
  x = jnp.asarray(rng.normal(size=(rows, 32)), jnp.bfloat16)
  want = np.asarray(x, np.float64) @ deq.T
  got = np.asarray(jax.jit(lambda x: quant_vocab.logits(owner, "embedding", x))(x), np.float64)
  assert got.shape == (rows, 48)
  assert np.abs(got - want).max() / np.abs(want).max() < 1e-6
  tokens = jnp.asarray(rng.integers(0, 48, (2, 5)), jnp.int32)
  looked = np.asarray(jax.jit(lambda t: quant_vocab.rows(owner, "embedding", t, jnp.float32))(
      tokens))
  np.testing.assert_array_equal(looked, (q.astype(np.float32) * s[:, None])[np.asarray(tokens)])
  np.testing.assert_array_equal(np.asarray(quant_vocab.dequantized(owner, "embedding")),
                                q.astype(np.float32) * s[:, None])


def test_row_gather_kernel_equals_take(monkeypatch):
  """kernels/row_gather.py (interpreted on the CPU): the rows of int8 tables whose row count is not
  a multiple of the tile (a partial last block), ids at both ends; and the lookup of an int8
  table through it (as on a TPU) gives the dequantized rows."""
  from MaxText.kernels import row_gather
  rng = np.random.default_rng(3)
  for v, d in ((64, 128), (100, 256)):    # (the owner below takes the last table)
    table = rng.integers(-128, 128, (v, d), dtype=np.int8)
    tokens = np.array([[0, v - 1, 37 % v, 5], [31, 32, 33, v - 2]], np.int32)
    got = np.asarray(jax.jit(row_gather.gather_rows)(jnp.asarray(table), jnp.asarray(tokens)))
    assert got.dtype == np.float32 and got.shape == (2, 4, d)
    np.testing.assert_array_equal(got, table[tokens].astype(np.float32))
  owner = _Owner(100, 256)
  quant_vocab.attach(owner, "")
  scale = rng.uniform(0.01, 1, 100).astype(np.float32)
  owner.embedding = nnx.Param(jnp.asarray(table), logical_axes=("vocab", "embed"))
  owner.embedding_scale = nnx.Param(jnp.asarray(scale), logical_axes=("vocab",))
  used = []
  monkeypatch.setattr(quant_vocab, "_gather_kernel", lambda: used.append(1) or True)
  looked = np.asarray(jax.jit(lambda t: quant_vocab.rows(owner, "embedding", t, jnp.float32))(
      jnp.asarray(tokens)))
  assert used
  np.testing.assert_array_equal(looked, (table.astype(np.float32) * scale[:, None])[tokens])


def test_the_key_needs_weight_bits_8():
  cfg = load_config([BASE_YML, "model_name=qwen3-tiny", "weight_quant_vocab=true"])
  for bits, refused in ((0, True), (4, True), (8, False)):
    keys = [k for k, _ in quant.problems(ModelConfig.from_config(replace(cfg, weight_bits=bits)))]
    assert ("weight_quant_vocab" in keys) == refused, bits


# ---- tiny models: logits and greedy tokens -----------------------------------------------------
def _config(model):
  return load_config([BASE_YML, f"model_name={model}", "dtype=float32", "weight_dtype=float32",
                      "jax_cache_dir="])


def _quantized(model):
  """(float cfg, int8 cfg, float params, int8 params (RTN, one scale per column / row), their
  dequantized floats)."""
  cfg = _config(model)
  mcfg = ModelConfig.from_config(cfg)
  params = jax.device_get(init_params(mcfg, 0))
  tgts = convert.targets(mcfg, "", vocab=True)
  qparams, _ = convert.quantize_params(params, tgts, "rtn", 8, 0, progress=False)
  deq = convert.dequantized(qparams, tgts, 8, jnp.float32)
  return cfg, replace(cfg, weight_bits=8, weight_quant_vocab=True), params, qparams, deq


@pytest.fixture(scope="module", params=["gemma4-tiny", "qwen3-tiny"])
def tiny(request):
  return (request.param, *_quantized(request.param))


def test_int8_tables_give_the_float_models_logits_on_the_dequantized_tables(tiny):
  """Tied head + per-layer-input table (Gemma 4) or untied head (Qwen3): the int8 model's logits
  are the float model's on the dequantized weights within float32 rounding, and much closer than
  to the float model's own (the tolerance tells quantized from not)."""
  model, cfg, qcfg, params, qparams, deq = tiny
  qdef = make_model_def(ModelConfig.from_config(qcfg))
  flat = {"/".join(map(str, k)): v for k, v in traverse_util.flatten_dict(qparams).items()}
  tables = ["embedding", "ple_embedding"] if model == "gemma4-tiny" else ["embedding"]
  for name in tables:
    _assert_rtn_rows(traverse_util.flatten_dict(params)[(name,)], flat[name], flat[name + "_scale"])
  if model == "qwen3-tiny":     # the untied head: int8 levels, a scale per vocabulary column
    assert flat["lm_head/kernel"].dtype == np.int8 and flat["lm_head/kernel_scale"].shape == (1, 384)
    assert qdef.head_paths == (("lm_head",),)
  else:
    assert qdef.head_paths == (("embedding",), ("embedding_scale",))
  abstract = traverse_util.flatten_dict(qdef.abstract_params)
  assert all(abstract[k].dtype == v.dtype for k, v in traverse_util.flatten_dict(qparams).items())
  tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 16), dtype=np.int32)
  pos, seg = np.broadcast_to(np.arange(16), (2, 16)), np.ones((2, 16), np.int32)
  fdef = make_model_def(ModelConfig.from_config(cfg))
  got = np.asarray(jax.jit(qdef.apply)(qparams, tokens, pos, seg))
  want = np.asarray(jax.jit(fdef.apply)(deq, tokens, pos, seg))
  orig = np.asarray(jax.jit(fdef.apply)(params, tokens, pos, seg))
  scale = np.abs(want).max()
  err, quant_err = np.abs(got - want).max() / scale, np.abs(orig - want).max() / scale
  assert err < 1e-5, err
  assert quant_err > 100 * max(err, 1e-7), (err, quant_err)
  # a logit lens's matrix [V, D]: the dequantized table (tied) or head kernel (untied), as floats
  lens = np.asarray(jax.jit(lambda p: nnx.merge(qdef.graphdef, p).unembedding())(qparams))
  deq_flat = traverse_util.flatten_dict(deq)
  head = deq_flat[("embedding",)] if model == "gemma4-tiny" else deq_flat[("lm_head", "kernel")].T
  np.testing.assert_allclose(lens, head, rtol=1e-6, atol=0)


def _greedy(cfg, params, eos=()):
  from MaxText import inference
  model = inference.load(cfg, jax.devices()[:1], params=params, per_layer=True)
  model.eos_ids = list(eos)
  return model.generate(PROMPTS, max_new_tokens=NEW)


def test_int8_tables_decode_the_dequantized_models_greedy_tokens(tiny):
  """Decoding (prefill + one-token steps through the int8 lookup and head) gives the greedy tokens
  of the float model on the dequantized weights, log-probabilities within float32 rounding."""
  _, cfg, qcfg, _, qparams, deq = tiny
  got, want = _greedy(qcfg, qparams), _greedy(cfg, deq)
  for g, w in zip(got, want):
    assert len(g.output_ids) == NEW and g.output_ids == w.output_ids
    np.testing.assert_allclose(g.output_logprobs, w.output_logprobs, atol=1e-4)


# ---- the quantize CLI, the decode CLI and the export ----------------------------------------------
@pytest.mark.timeout(1200)
def test_quantize_cli_round_trip(tmp_path, capsys):
  """A float Gemma 4 tiny checkpoint → `MaxText.quantize method=rtn bits=8 group_size=0
  weight_quant_vocab=true`: its config says so, the tables restore as int8 levels + per-row scales
  equal to NumPy's RTN of the float tables; the decode CLI reads it and decodes the engine's
  greedy tokens of the same int8 weights; to_huggingface writes the dequantized tables. bits=4
  with the key exits 2 naming it."""
  from MaxText import decode, quantize
  from MaxText.checkpoint.manager import load_params_host, read_meta, save_params_only
  from MaxText.checkpoint_conversion import to_huggingface
  cfg, qcfg, params, qparams, _ = _quantized("gemma4-tiny")
  fp = str(tmp_path / "fp")
  save_params_only(fp, params, cfg.as_dict())
  common = [BASE_YML, f"load_parameters_path={fp}", f"base_output_directory={tmp_path}",
            "run_name=q", "method=rtn", "weight_quant_vocab=true"]
  assert quantize.main([*common, f"output_path={tmp_path / 'q4'}", "bits=4"]) == 2
  assert "weight_quant_vocab" in capsys.readouterr().err
  q8 = str(tmp_path / "q8")
  assert quantize.main([*common, f"output_path={q8}", "bits=8", "group_size=0"]) == 0
  assert "embedding: relative weight error" in capsys.readouterr().out
  saved = read_meta(q8)["config"]
  assert (saved["weight_bits"], saved["weight_quant_vocab"]) == (8, True)
  qdef = make_model_def(ModelConfig.from_config(replace(cfg, weight_bits=8,
                                                        weight_quant_vocab=True)))
  restored = traverse_util.flatten_dict(load_params_host(q8, qdef.abstract_params))
  for name in ("embedding", "ple_embedding"):
    _assert_rtn_rows(traverse_util.flatten_dict(params)[(name,)], restored[(name,)],
                     restored[(name + "_scale",)])
  out = tmp_path / "o.jsonl"
  assert decode.main([BASE_YML, f"load_parameters_path={q8}", "dtype=float32",
                      f"prompt_ids={','.join(map(str, PROMPTS[0]))}", f"max_new_tokens={NEW}",
                      "eos_ids=[0]", f"decode_output={out}"]) == 0
  with open(out, encoding="utf-8") as f:
    got = json.loads(f.readline())["output_ids"]
  assert got == _greedy(qcfg, qparams, eos=[0])[0].output_ids
  from safetensors.numpy import load_file
  hf = tmp_path / "hf"
  assert to_huggingface.main([f"load_parameters_path={q8}", f"output_path={hf}"]) == 0
  exported = {k: v for f in os.listdir(hf) if f.endswith(".safetensors")
              for k, v in load_file(str(hf / f)).items()}
  emb = next(v for k, v in exported.items() if k.endswith("embed_tokens.weight"))
  q, s = restored[("embedding",)], restored[("embedding_scale",)]
  np.testing.assert_array_equal(emb.astype(np.float32), q.astype(np.float32) * s[:, None])


# ---- benchmarks/int8_init.py ----------------------------------------------------------------------
def test_int8_init_draws_the_quantized_tables_and_read_bytes_counts_them(monkeypatch):
  """With weight_quant_vocab each table is made in pieces of rows (CHUNK made small), and equals
  the RTN (`convert.quantize_table`) of the float table the same init draws without the key, bit
  for bit; `read_bytes` counts the tied head's table and scales whole, the per-layer-input table
  and its scales by the step's rows."""
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  import int8_init
  monkeypatch.setattr(int8_init, "CHUNK", 1 << 14)
  cfg = load_config([BASE_YML, "model_name=gemma4-tiny", "dtype=float32", "weight_bits=8"])
  made = {}
  for vocab in (False, True):
    mcfg = ModelConfig.from_config(replace(cfg, weight_quant_vocab=vocab))
    params, _ = int8_init.params(mcfg, 0, layers=True)
    made[vocab] = {k: np.asarray(jax.device_get(v))
                   for k, v in traverse_util.flatten_dict(params).items()}
  for name in ("embedding", "ple_embedding"):
    table = made[False][(name,)]
    assert table.size > int8_init.CHUNK                     # made in pieces
    q, s, _ = convert.quantize_table(table)
    np.testing.assert_array_equal(made[True][(name,)], q)
    np.testing.assert_array_equal(made[True][(name + "_scale",)], s)
  mcfg = int8_init.per_layer(ModelConfig.from_config(replace(cfg, weight_quant_vocab=True)))
  model_def = make_model_def(mcfg)
  params = traverse_util.unflatten_dict(made[True])
  total = sum(v.nbytes for v in made[True].values())
  ple = made[True][("ple_embedding",)].nbytes + made[True][("ple_embedding_scale",)].nbytes
  batch = 3
  assert int8_init.read_bytes(model_def, params, batch) == total - ple + batch * ple // 384
