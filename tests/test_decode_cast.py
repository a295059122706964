"""The decoding tools cast a checkpoint's weights on load (`resolve/lora_base.load_cast`): a float32
checkpoint decoded with weight_dtype=bfloat16 holds bf16 parameters equal bit for bit to the
checkpoint's values cast by hand, and its greedy tokens and their log-probabilities are those of
the hand-cast weights (the Python API, `inference.load`, which `python -m MaxText.decode` and the
server load through)."""
import jax
import ml_dtypes
import numpy as np

from conftest import BASE_YML
from MaxText import inference
from MaxText.checkpoint.manager import RunCheckpoints, load_params_host
from MaxText.config.load import load_config, replace
from MaxText.models.model_config import ModelConfig
from MaxText.models.registry import init_params

MODEL = ["model_name=qwen3-tiny", "max_position_embeddings=64", "max_target_length=64",
         "ici_fsdp_parallelism=1"]


def test_float32_checkpoint_decodes_in_bfloat16(tmp_path):
  cfg = load_config([BASE_YML, *MODEL])
  assert cfg.weight_dtype == "float32"
  # a training run's checkpoint (with its integrity manifest, which names each array's dtype)
  path = str(tmp_path / "c")
  params = jax.device_put(init_params(ModelConfig.from_config(cfg), 0), jax.devices()[0])
  ckpts = RunCheckpoints(path, max_to_keep=1, async_save=False)
  ckpts.save(1, {"params": params, "opt_state": {"count": jax.device_put(np.int32(0))}}, None,
             cfg.as_dict())
  ckpts.close()
  one = jax.devices()[:1]
  model = inference.load([BASE_YML, *MODEL, f"load_parameters_path={path}",
                          "weight_dtype=bfloat16"], one)
  saved = load_params_host(path, model.engine.model_def.abstract_params)   # float32, as saved
  assert {x.dtype for x in jax.tree.leaves(saved)} == {np.dtype(np.float32)}
  by_hand = jax.tree.map(lambda x: x.astype(ml_dtypes.bfloat16), saved)
  for got, want in zip(jax.tree.leaves(model.params), jax.tree.leaves(by_hand)):
    assert got.dtype == want.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(np.asarray(jax.device_get(got)), want)
  oracle = inference.load(replace(model.cfg), one, params=by_hand)
  prompts = ["def f(", "import os"]
  got = model.generate(prompts, max_new_tokens=12, eos_ids=[-1])
  want = oracle.generate(prompts, max_new_tokens=12, eos_ids=[-1])
  assert [g.output_ids for g in got] == [w.output_ids for w in want]
  assert [g.output_logprobs for g in got] == [w.output_logprobs for w in want]
