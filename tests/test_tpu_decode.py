"""On the TPU chip only (marked `tpu`: skipped elsewhere, CI included): greedy decoding on the chip
writes the CPU engine's tokens, every family, in float32 at `highest` precision
(`matmul_precision=auto` resolves to it for float32), the cache in float32 too, the XLA attention
on both sides, the same parameters (the CPU's threefry init, placed on each side) and the
decoding tools' layout (`inference.load(per_layer=True)`: restacked per layer). The CPU side is
a subprocess (JAX_PLATFORMS=cpu) started when the module is imported on the chip, so both run at
once. Run there in one process (one process holds the chip):

  JAX_PLATFORMS=tpu,cpu python3 -m pytest -q -n 0 -m tpu tests/test_tpu_decode.py

The log-probabilities (up to the first differing token) agree within 1e-4, or, for a family whose
decoding amplifies float32 errors more, within SENSITIVITY times how far the chip's transcendental
errors emulated on the CPU move them (`greedy_emulated`: benchmarks/cpu_emulate_chip.py, as
tests/test_tpu.py's bounds; measured there: gemma4 4.8e-4, qwen3-next 1.7e-4, qwen3 4.2e-5).
Each measurement goes to $TPU_TEST_RECORD (one JSON line) before its assertion.
"""
from __future__ import annotations

import contextlib
import os
import sys

import numpy as np
import pytest

from tests.tpu_reference import CpuReference, cpu_result, record

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.tpu

FAMILIES = {"llama": [], "qwen3": ["model_name=qwen3-tiny"],
            "qwen3-moe": ["model_name=qwen3-moe-tiny"], "gemma4": ["model_name=gemma4-tiny"],
            "qwen3-next": ["model_name=qwen3-next-tiny"],
            # int8 weights (RTN of the same init on both sides), the vocabulary tables too: on the
            # chip the lookups go through the row-gather kernel (MaxText/kernels/row_gather.py)
            "gemma4 int8 vocab": ["model_name=gemma4-tiny", "weight_bits=8",
                                  "weight_quant_vocab=true"]}
EXACT = ["dtype=float32", "weight_dtype=float32", "cache_dtype=float32",
         "param_init_rng=threefry2x32", "attention=dot_product", "ici_fsdp_parallelism=1",
         "max_position_embeddings=128", "jax_cache_dir="]
# on the chip only, against the CPU's tokens of the family named first: the decoding step's
# attention on XLA's einsums (the other rows take `decode_attention=auto`: the Pallas kernel on a
# TPU; Gemma 4's sliding layers keep the einsums)
KERNEL_ROWS = {"qwen3 decode_attention=xla": ("qwen3", ["decode_attention=xla"]),
               "gemma4 decode_attention=xla": ("gemma4", ["decode_attention=xla"])}
PROMPT_LENGTHS = (5, 17, 3)
NEW_TOKENS = 24
LOGPROB_ATOL = 1e-4
SENSITIVITY = 4.0   # x the emulated chip errors' effect (one pseudo-random draw of them), as test_tpu


def greedy(keys: list[str]) -> dict:
  """Greedy tokens and their log-probabilities of `keys`' model (seed 0, initialised on the CPU;
  with weight_bits, its float init quantized by RTN there) for seeded prompts, decoded on this
  process's first device."""
  import jax  # pylint: disable=import-outside-toplevel

  from MaxText import inference  # pylint: disable=import-outside-toplevel
  from MaxText.config.load import load_config, replace  # pylint: disable=import-outside-toplevel
  from MaxText.models.model_config import ModelConfig  # pylint: disable=import-outside-toplevel
  from MaxText.models.registry import init_params  # pylint: disable=import-outside-toplevel
  from MaxText.quantization import convert  # pylint: disable=import-outside-toplevel

  cfg = load_config([os.path.join(ROOT, "configs/base.yml"), *keys])
  mcfg = ModelConfig.from_config(replace(cfg, weight_bits=0, weight_quant_vocab=False))
  with jax.default_device(jax.devices("cpu")[0]):
    host = jax.device_get(init_params(mcfg, 0))
    if cfg.weight_bits:   # (its per-matrix lines on stderr: the reference's stdout is its JSON)
      with contextlib.redirect_stdout(sys.stderr):
        host, _ = convert.quantize_params(
            host, convert.targets(mcfg, cfg.weight_quant_exclude, cfg.weight_quant_vocab), "rtn",
            cfg.weight_bits, cfg.weight_group_size, progress=False)
  model = inference.load(cfg, jax.devices()[:1], params=host, per_layer=True)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, mcfg.vocab_size, n).tolist() for n in PROMPT_LENGTHS]
  out = model.engine.generate(model.params, prompts, max_new_tokens=NEW_TOKENS)
  return {"tokens": [c.output_ids for c in out], "logprobs": [c.output_logprobs for c in out],
          "platform": jax.devices()[0].platform, "matmul_precision": model.cfg.matmul_precision,
          "per_layer": model.engine.layout.is_per_layer(model.params)}


def greedy_emulated(keys: list[str]) -> dict:
  """`greedy` on the CPU with the chip's float32 transcendental errors emulated
  (benchmarks/cpu_emulate_chip.py's `perturbed` at its CHIP_EPS)."""
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  import cpu_emulate_chip as emulate  # pylint: disable=import-outside-toplevel
  with emulate.perturbed(emulate.CHIP_EPS):
    return greedy(keys)


@pytest.fixture(scope="module")
def cpu_decoding():
  yield from _REFERENCE.process()


@pytest.fixture(scope="module")
def cpu_emulated_decoding():
  yield from _EMULATED.process()


def _first_difference(a: list[list[int]], b: list[list[int]]):
  """(row, new-token index) of the first token that differs, or None."""
  for r, (x, y) in enumerate(zip(a, b)):
    for i, (s, t) in enumerate(zip(x, y)):
      if s != t:
        return r, i
  return None


def _logprob_error(a: dict, b: dict) -> float:
  """The largest log-probability difference up to the first differing token (the same contexts)."""
  diff = _first_difference(a["tokens"], b["tokens"])
  return max(abs(x - y) for r, (p, q) in enumerate(zip(a["logprobs"], b["logprobs"]))
             for i, (x, y) in enumerate(zip(p, q)) if diff is None or (r, i) < diff)


@pytest.mark.parametrize("family", [*FAMILIES, *KERNEL_ROWS])
def test_greedy_tokens_on_the_chip_equal_the_cpu_in_float32(family, cpu_decoding,
                                                            cpu_emulated_decoding):
  base, extra = KERNEL_ROWS.get(family, (family, []))
  tpu = greedy([*FAMILIES[base], *extra, *EXACT])
  assert tpu["platform"] == "tpu" and tpu["matmul_precision"] == "highest", tpu
  assert tpu["per_layer"], tpu
  cpu = cpu_result(cpu_decoding)[base]
  assert cpu["platform"] == "cpu", cpu
  diff = _first_difference(tpu["tokens"], cpu["tokens"])
  lp_error = _logprob_error(tpu, cpu)
  emulated = cpu_result(cpu_emulated_decoding)[base]
  assert emulated["platform"] == "cpu", emulated
  bound = max(LOGPROB_ATOL, SENSITIVITY * _logprob_error(emulated, cpu))
  record(f"decode greedy {family}", tpu=tpu["tokens"], cpu=cpu["tokens"],
         first_difference=diff, logprob_max_abs_error=lp_error, logprob_bound=bound)
  assert all(len(t) == NEW_TOKENS for t in tpu["tokens"]), tpu["tokens"]
  assert tpu["tokens"] == cpu["tokens"], f"first difference at (row, token) {diff}"
  assert lp_error <= bound, (lp_error, bound)


# on the chip, the CPU reference starts as soon as the module is imported (collection)
_REFERENCE = CpuReference("tests.test_tpu_decode", "greedy")
_EMULATED = CpuReference("tests.test_tpu_decode", "greedy_emulated")
