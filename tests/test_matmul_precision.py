"""`matmul_precision` (MaxText/config/load.py `resolve_precision`): auto is highest with float32
compute and default otherwise, and the programs that trace the model carry it — every dot of the
train step (its backward's custom VJP rules included) and of the decoding engine's programs. On a
CPU a float32 dot is exact at any precision, so the test reads the lowered programs (StableHLO's
`precision = [...]` of each dot), nothing is compiled. The start-up line: tests/test_auto_settings.py."""
import re

import jax
import jax.numpy as jnp
import pytest

from conftest import BASE_YML, MESH_1, argv
from decoding_helpers import engine
from MaxText.config.load import load_config
from MaxText.models.model_config import ModelConfig
from MaxText.resolve import auto_settings
from MaxText.train import loop


def _dot_precisions(text: str) -> set[str]:
  dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
  assert dots
  return {re.search(r"precision = \[(\w+), \w+\]", line).group(1) for line in dots}


def test_auto_is_highest_for_float32_and_default_otherwise():
  assert load_config([BASE_YML]).matmul_precision == "highest"    # the tools compute in float32
  training = auto_settings.for_training(load_config([BASE_YML], keep_auto=True))
  assert (training.cfg.dtype, training.cfg.matmul_precision) == ("bfloat16", "default")
  for dtype, want in (("float32", "highest"), ("bfloat16", "default"), ("float16", "default")):
    given = load_config([BASE_YML, f"dtype={dtype}"], keep_auto=True)
    assert auto_settings.for_training(given).cfg.matmul_precision == want
    assert load_config([BASE_YML, f"dtype={dtype}"]).matmul_precision == want
  for chosen in ("default", "high", "highest"):   # a set value is kept, whatever the dtype
    assert load_config([BASE_YML, "dtype=float32", f"matmul_precision={chosen}"]
                       ).matmul_precision == chosen


@pytest.mark.parametrize("keys,want", [(("dtype=float32",), {"HIGHEST"}),
                                       (("dtype=bfloat16",), {"DEFAULT"}),
                                       (("dtype=float32", "matmul_precision=high"), {"HIGH"})])
def test_the_train_step_carries_it(tmp_path, keys, want):
  trainer = loop.Trainer(load_config(argv(tmp_path, "p", *MESH_1, *keys), keep_auto=True),
                         jax.devices()[:1])
  assert _dot_precisions(trainer.lower_step().as_text()) == want


@pytest.mark.parametrize("keys,want", [((), {"HIGHEST"}), (("dtype=bfloat16",), {"DEFAULT"})])
def test_the_decoding_engine_carries_it(keys, want):
  """The engine's programs (decode, the Python API, serve) trace through `Engine._counted`: one
  of its forwards lowered (the tools resolve dtype=auto to float32)."""
  mcfg = ModelConfig.from_config(load_config([BASE_YML, *MESH_1, *keys]))
  eng = engine(mcfg)
  tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)

  def forward(params, tokens):
    positions = jnp.broadcast_to(jnp.arange(8), (1, 8))
    return eng._model(params).forward_with_aux(tokens, positions, jnp.ones((1, 8), jnp.int32))[0]

  text = jax.jit(eng._counted(forward)).lower(eng.model_def.abstract_params, tokens).as_text()
  assert _dot_precisions(text) == want
