"""Gemma 4's audio tower (MaxText/models/gemma4/audio.py, audio_layers.py) against transformers'
(`Gemma4Model.get_audio_features`: the conformer's output and its mask), through
the name map of MaxText/models/gemma4/hf_map_audio.py. A tiny random-init
`Gemma4ForConditionalGeneration` (fp32, text + audio) in two tower variants:
  clipped  HF's default chunk geometry (12 / 13 / 0), clipped linears with finite bounds (so they
           clip), silu, scanned layers;
  wrapped  another chunk geometry (8 / 3 / 1: keys ahead of the query too; W // 2 is not the left
           context, so transformers' relative shift offsets the positions, and wraps rows the
           window masks), a small activation clamp and logit cap, gelu, no clipped linears,
           unscanned.
Inputs: transformers' own feature extractor on two random clips of different lengths (the shorter
padded: its mask is part of the check). Norm weights, per-dim scales and the output bias are
perturbed away from their init."""
import functools
from typing import Callable

import jax
import numpy as np
import pytest
from flax import nnx, traverse_util

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import BASE_YML  # noqa: E402
from hf_parity import build_hf_model, hf_state  # noqa: E402
from MaxText.backend import hot_path  # noqa: E402
from MaxText.config.load import load_config, replace  # noqa: E402
from MaxText.models.gemma4 import hf_map, hf_map_audio  # noqa: E402
from MaxText.models.gemma4.audio import AudioTower  # noqa: E402
from MaxText.models.model_config import ModelConfig  # noqa: E402
from MaxText.models.model_def import model_def_of  # noqa: E402

TEXT = ["model_name=gemma4-tiny", "attention_pattern=sf", "num_decoder_layers=2",
        "num_kv_shared_layers=0", "double_wide_mlp_on_shared=false", "per_layer_input_dim=0",
        "per_layer_input_vocab_size=0"]
TOWER = ["audio_hidden_size=32", "audio_num_layers=2", "audio_num_heads=4",
         "audio_subsampling_channels=[128,4]", "audio_output_dim=48", "audio_norm_epsilon=1e-5"]
VARIANTS = {
    "clipped": ["scan_layers=true"],
    "wrapped": ["audio_chunk_size=8", "audio_context_left=3", "audio_context_right=1",
                "audio_gradient_clipping=2.0", "audio_activation=gelu_tanh", "audio_logit_cap=2.0",
                "audio_clipped_linears=false", "audio_conv_kernel_size=3", "scan_layers=false"],
}
SECONDS = (1.0, 0.55)   # two clips: the second padded to the first's frames
TOL = 1e-4


def our_config(variant: str, *extra: str):
  return load_config([BASE_YML, *TEXT, *TOWER, *VARIANTS[variant], *extra])


def hf_config(cfg) -> dict:
  """The multimodal HF config: the text model's (as the text map writes it) and the tower's."""
  return {"text_config": hf_map.config_to_hf(load_config([BASE_YML, *TEXT])),
          "audio_config": hf_map_audio.config_to_hf(cfg), "vision_config": None}


@functools.lru_cache(maxsize=None)
def hf_model(variant: str):
  """The HF model; norms, per-dim scales and the output bias perturbed, q/k projections scaled
up; with clipped linears, bounds of ±U(1, 2) (the projections' inputs and outputs are of that
size, so they clip)."""
  model = build_hf_model(transformers.Gemma4Config, transformers.Gemma4ForConditionalGeneration,
                         hf_config(our_config(variant)),
                         perturb=("norm.weight", "norm_pre_attn.weight", "norm_post_attn.weight",
                                  "norm_out.weight", "per_dim_scale", "output_proj.bias"))
  gen = torch.Generator().manual_seed(1)
  with torch.no_grad():
    for name, w in model.named_parameters():   # logits of a few units: a peaked softmax, the cap bites
      if name.endswith(("q_proj.linear.weight", "k_proj.linear.weight")):
        w.mul_(6.0)
    for name, b in model.named_buffers():
      if name.endswith(("input_min", "output_min", "input_max", "output_max")):
        sign = -1.0 if name.endswith("min") else 1.0
        b.copy_(sign * (1.0 + torch.rand((), generator=gen)))
  return model


@functools.lru_cache(maxsize=None)
def features():
  """transformers' feature extractor on two random clips (16 kHz): features [2, S, 128], mask."""
  fe = transformers.Gemma4AudioFeatureExtractor()
  rng = np.random.default_rng(0)
  clips = [(0.1 * rng.standard_normal(int(s * fe.sampling_rate))).astype(np.float32)
           for s in SECONDS]
  out = fe(clips, return_tensors="np")
  feats, mask = np.asarray(out["input_features"], np.float32), np.asarray(out["input_features_mask"])
  assert mask[0].all() and not mask[1].all()     # the second clip is padded
  return feats, mask


@functools.lru_cache(maxsize=None)
def ours(variant: str):
  """(ModelConfig from the HF config, the tower's model def, params converted from HF)."""
  model = hf_model(variant)
  cfg = replace(our_config(variant), **hf_map_audio.config_from_hf(model.config.to_dict()))
  assert cfg == our_config(variant)   # config_to_hf → HF config → config_from_hf
  mcfg = ModelConfig.from_config(cfg)
  return mcfg, model_def_of(AudioTower, mcfg), hf_map_audio.hf_to_params(hf_state(model), mcfg)


_RUNS: dict[int, Callable] = {}


def run_ours(model_def):
  """The tower's jitted forward (one per model def)."""
  if id(model_def) in _RUNS:
    return _RUNS[id(model_def)]

  def run(params, feats, mask):
    with hot_path.use(model_def.hot_path):
      return nnx.merge(model_def.graphdef, params)(feats, mask)
  return _RUNS.setdefault(id(model_def), jax.jit(run))


def hf_outputs(variant: str):
  feats, mask = features()
  with torch.no_grad():
    out = hf_model(variant).model.get_audio_features(torch.tensor(feats), torch.tensor(mask),
                                                     return_dict=True)
  return out.last_hidden_state.numpy(), out.attention_mask.numpy()


def close(got, want, what: str) -> float:
  err = float(np.abs(np.asarray(got) - want).max() / np.abs(want).max())
  assert err <= TOL, f"{what}: max error {err:.2e} of the largest magnitude"
  return err


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_audio_tower_matches_hf(variant):
  mcfg, model_def, params = ours(variant)
  hidden_hf, valid_hf = hf_outputs(variant)
  feats, mask = features()
  hidden, valid = run_ours(model_def)(params, feats, mask)
  np.testing.assert_array_equal(np.asarray(valid), valid_hf)
  assert valid_hf[0].all() and 0 < valid_hf[1].sum() < valid_hf.shape[1]
  assert hidden.shape == (*valid_hf.shape, mcfg.audio_output_dim)
  err = close(hidden, hidden_hf, "the tower's output")   # every frame, the padding's too
  print(f"{variant}: max error {err:.1e} of the largest magnitude")


def test_audio_features_are_live():
  """The clipped linears' bounds, the padding mask, the logit cap and the activation clamp change
  the output (so the parity above covers them)."""
  mcfg, model_def, params = ours("clipped")
  feats, mask = features()
  run = run_ours(model_def)
  base = np.asarray(run(params, feats, mask)[0])
  unbounded = traverse_util.unflatten_dict({
      k: (np.full_like(v, -np.inf if k[-1].endswith("min") else np.inf)
          if k[-1] in ("input_min", "input_max", "output_min", "output_max") else v)
      for k, v in traverse_util.flatten_dict(params).items()})
  assert np.abs(np.asarray(run(unbounded, feats, mask)[0]) - base).max() > 1e-3
  full = np.asarray(run(params, feats, np.ones_like(mask))[0])
  assert np.abs(full[1] - base[1]).max() > 1e-3 and np.abs(full[0] - base[0]).max() == 0
  _, model_def, params = ours("wrapped")
  base = np.asarray(run_ours(model_def)(params, feats, mask)[0])
  for keys in ({"audio_logit_cap": 50.0}, {"audio_gradient_clipping": 1e10}):
    other = np.asarray(run_ours(ours_with("wrapped", **keys))(params, feats, mask)[0])
    assert np.abs(other - base).max() > 1e-3, keys


def ours_with(variant: str, **keys):
  return model_def_of(AudioTower, ModelConfig.from_config(replace(our_config(variant), **keys)))


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("scan", [True, False])
def test_audio_map_round_trips_bitwise(variant, scan):
  """HF → ours → HF gives every audio tensor back bit for bit (both layer layouts), hf_names lists
  exactly them, and the text map ignores them."""
  sd = hf_state(hf_model(variant))
  audio = {k: v for k, v in sd.items() if hf_map_audio.is_audio_name(k)}
  assert any(".input_min" in k for k in audio) == (variant == "clipped")
  mcfg = ModelConfig.from_config(replace(our_config(variant), scan_layers=scan))
  params = hf_map_audio.hf_to_params(sd, mcfg)
  shapes = lambda t: jax.tree.map(lambda a: (tuple(a.shape), np.dtype(a.dtype)), t)
  assert shapes(params) == shapes(model_def_of(AudioTower, mcfg).abstract_params)
  back = hf_map_audio.params_to_hf(params, mcfg)
  assert sorted(back) == sorted(audio) == sorted(hf_map_audio.hf_names(mcfg))
  for k, v in audio.items():
    assert back[k].dtype == v.dtype and np.array_equal(back[k], v, equal_nan=True), k


def test_audio_map_is_strict():
  sd = hf_state(hf_model("wrapped"))
  mcfg, _, _ = ours("wrapped")
  name = "model.audio_tower.layers.1.lconv1d.depthwise_conv1d.weight"
  with pytest.raises(ValueError, match="lacks " + name.replace(".", r"\.")):
    hf_map_audio.hf_to_params({k: v for k, v in sd.items() if k != name}, mcfg)
  with pytest.raises(ValueError, match="no place.*layers.2"):
    hf_map_audio.hf_to_params({**sd, "model.audio_tower.layers.2.norm_out.weight":
                               sd["model.audio_tower.layers.1.norm_out.weight"]}, mcfg)
  with pytest.raises(ValueError, match="shape"):
    hf_map_audio.hf_to_params({**sd, name: sd[name][:, :, :2]}, mcfg)
  with pytest.raises(ValueError, match="audio_hidden_size=0"):
    hf_map_audio.hf_to_params(sd, ModelConfig.from_config(replace(our_config("wrapped"),
                                                                  audio_hidden_size=0)))


def test_mel_bins_checked():
  _, model_def, params = ours("wrapped")
  feats, mask = features()
  with pytest.raises(ValueError, match="64 mel bins.*takes 128"):
    run_ours(model_def)(params, feats[..., :64], mask)
