"""Decoding with the parameters restacked per layer (`decode_unroll_layers`,
MaxText/decoding/layout.py): the same greedy tokens and log-probabilities as the scanned layout
through `generate` on a tiny model of each family whose stack has different runs (one run; Gemma
4's sliding / full / KV-shared runs; Qwen3-Next's linear and full attention), and through `score`
and the server's Slots on Gemma 4's (every call restacks through the same `Engine.run_params`
into the same unscanned model, whatever the family: the family's runs are generate's to show);
the restacked arrays are the stacked ones' rows, and their program has no loop over the layers
(else the comparison is of one program with itself)."""
import jax
import numpy as np
import pytest
from flax import traverse_util

from conftest import BASE_YML
from decoding_helpers import engine
from MaxText.config.load import load_config
from MaxText.decoding.slots import Slots
from MaxText.models.model_config import ModelConfig
from MaxText.models.registry import init_params

# Gemma 4 at one layer of each kind (sliding, full, KV-shared), as tests/test_bf16_weights.py
GEMMA4 = ["model_name=gemma4-tiny", "num_decoder_layers=3", "attention_pattern=sff",
          "num_kv_shared_layers=1"]
# Qwen3-Next at [linear x 2, full]: a scanned run of two linear layers (a loop the restacking
# removes) and the full layer's run, as qwen3-next-tiny's [linear x 3, full], one linear layer fewer
# to compile in each unrolled program (~13 % of this case's CPU)
FAMILIES = {"llama": [], "gemma4": GEMMA4,
            "qwen3-next": ["model_name=qwen3-next-tiny", "num_decoder_layers=3",
                           "attention_pattern=llf"]}
GREEDY = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 0}


def _model(keys):
  cfg = load_config([BASE_YML, "ici_fsdp_parallelism=1", "dtype=float32", *keys])
  mcfg = ModelConfig.from_config(cfg)
  assert mcfg.scan_layers
  return mcfg, jax.device_get(init_params(mcfg, 0))


def test_restacked_parameters_are_the_rows_and_run_without_a_layer_loop():
  # the llama case's model, one run of 4 layers (its init and its arrays' slices compile once for
  # the file; the runs of several kinds, one of two layers, are Qwen3-Next's below: its Gated
  # DeltaNet scans over positions, so "no scan" is shown here)
  mcfg, host = _model(FAMILIES["llama"])
  eng = engine(mcfg, unroll_layers=True)
  scanned = eng.place(host)
  per_layer = eng.per_layer(scanned)
  assert eng.layout.is_per_layer(per_layer) and not eng.layout.is_per_layer(scanned)
  flat = traverse_util.flatten_dict(jax.device_get(per_layer))
  stacked = traverse_util.flatten_dict(host)
  assert len(flat) > len(stacked)
  for path, (source, k) in eng.layout.mapping().items():
    np.testing.assert_array_equal(flat[path], stacked[source] if k is None else stacked[source][k])
  assert eng.run_params(scanned) is not scanned and eng.run_params(per_layer) is per_layer
  tokens = np.zeros((1, 8), np.int32)
  positions = np.arange(8, dtype=np.int32)[None]

  def jaxpr(params) -> str:
    def forward(p):
      with eng.model_def.traced():
        return eng._model(p).extend(tokens, positions, positions >= 0, None,  # noqa: SLF001
                                    prefill=True)[0]
    return str(jax.make_jaxpr(forward)(params))
  # (the printed jaxpr holds every sub-jaxpr: a scan prints as `scan[`)
  assert " scan[" in jaxpr(scanned)
  assert " scan[" not in jaxpr(per_layer)


# score and Slots on one family: Gemma 4's, the most kinds of runs (sliding, full, KV-shared)
THROUGH_ALL = "gemma4"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_unrolled_decoding_equals_the_scan(family):
  mcfg, host = _model(FAMILIES[family])
  rng = np.random.default_rng(1)
  prompts = [rng.integers(1, mcfg.vocab_size, n).tolist() for n in (5, 11, 3)]
  everywhere = family == THROUGH_ALL
  got = {}
  for unroll in (False, True):
    eng = engine(mcfg, batch_size=4, chunk=4, unroll_layers=unroll)
    params = eng.place(host)
    out = eng.generate(params, prompts, max_new_tokens=9)
    got[unroll] = ([o.output_ids for o in out], [o.output_logprobs for o in out])
    if not everywhere:
      continue
    scored = eng.score(params, prompts, [o.output_ids for o in out])
    slots = Slots(eng, 4, 64, chunk=4)
    first = slots.prefill(params, prompts, [0, 1, 2], [0, 1, 2], [GREEDY] * 3, 0)[0]
    state = {"token": np.zeros(4, np.int32), "position": np.zeros(4, np.int32),
             "count": np.ones(4, np.int32), "max_new": np.full(4, 6, np.int32),
             "done": np.array([False, False, False, True]), "row": np.arange(4, dtype=np.int32)}
    state["token"][:3], state["position"][:3] = first, [len(p) for p in prompts]
    _, steps = slots.step(params, state, [], {k: np.broadcast_to(v, 4).copy() for k, v in
                                              {**GREEDY, "seed": np.uint32(0)}.items()}, 0)
    got[unroll] += (scored, first.tolist(), steps["tokens"].tolist(), steps["logprobs"])
  scanned, unrolled = got[False], got[True]
  assert unrolled[0] == scanned[0]
  assert all(len(t) == 9 for t in unrolled[0])
  np.testing.assert_allclose(np.concatenate(unrolled[1]), np.concatenate(scanned[1]),
                             rtol=1e-5, atol=1e-5)
  if everywhere:
    assert unrolled[3:5] == scanned[3:5]
    assert all(t >= 0 for row in unrolled[4][:3] for t in row)   # every busy slot made 4 tokens
    np.testing.assert_allclose(np.concatenate(unrolled[2]), np.concatenate(scanned[2]),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(unrolled[5], scanned[5], rtol=1e-5, atol=1e-5)
