"""Gemma 4 with both towers — vision and audio — against transformers'
`Gemma4ForConditionalGeneration` (the oracle): a tiny random model (fp32, eager attention) built
from our config through gemma4_hf_map.config_to_hf — the text model and vision tower of
tests/test_gemma4_vision.py, plus a 2-layer audio conformer (clipped linears with finite bounds).
Norm weights, per-dim scales, the position table, the standardization buffers and the layer
scalars are perturbed.

Two prompts, each with one image and one audio clip, of different sizes (images of 60 and 66
soft tokens from transformers' image processor; clips of 1.0 s and 0.55 s from its feature
extractor, the second padded): our batch of both against transformers run on each prompt (logits
and every hidden state within 1e-4 of their largest magnitude); the audio is live; the state-dict
and the converters' round trips with both towers; greedy decoding with audio against
transformers' generate (40 tokens); the FLOP, memory and frozen counts of the audio tower."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import BASE_YML  # noqa: E402
from hf_parity import check_round_trip, hf_state  # noqa: E402
from MaxText.config.load import load_config, replace  # noqa: E402
from MaxText.layers import sites  # noqa: E402
from MaxText.models.gemma4 import gemma4_hf_map  # noqa: E402
from MaxText.models.model_config import ModelConfig  # noqa: E402
from MaxText.models.registry import make_model_def  # noqa: E402
from test_gemma4_vision import OVERRIDES, TOL, greedy  # noqa: E402

IMAGE, BOI, EOI, AUDIO, BOA, EOA = 380, 378, 379, 382, 376, 377
AUDIO_TOWER = ["audio_hidden_size=32", "audio_num_layers=2", "audio_num_heads=4",
               "audio_subsampling_channels=[128,4]", "audio_output_dim=48",
               "audio_norm_epsilon=1e-5"]
SECONDS = (1.0, 0.55)


def our_config(*extra: str):
  """A later value of a key replaces an earlier one."""
  merged = dict(item.split("=", 1) for item in [*OVERRIDES, *AUDIO_TOWER, *extra])
  return load_config([BASE_YML, *(f"{k}={v}" for k, v in merged.items())])


@functools.lru_cache(maxsize=None)
def hf_model(*extra: str):
  """The oracle of `our_config(*extra)` (no `extra`: this file's)."""
  hf = gemma4_hf_map.config_to_hf(our_config(*extra))
  assert hf["audio_config"] is not None and hf["vision_config"] is not None
  for part in ("text_config", "vision_config"):
    hf[part]["initializer_range"] = 0.2
  config = transformers.Gemma4Config(**hf, attn_implementation="eager")
  torch.manual_seed(0)
  model = transformers.Gemma4ForConditionalGeneration(config).float().eval()
  g = torch.Generator().manual_seed(1)
  with torch.no_grad():
    for name, p in [*model.named_parameters(), *model.named_buffers()]:
      if name.endswith(("norm.weight", "norm_pre_attn.weight", "norm_post_attn.weight",
                        "norm_out.weight", "layer_scalar", "std_scale",
                        "position_embedding_table")):
        p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
      elif name.endswith(("std_bias", "per_dim_scale", "output_proj.bias")):
        p.copy_(0.3 * torch.randn(p.shape, generator=g))
      elif name.endswith(("input_min", "output_min")):   # finite bounds that clip some values
        p.fill_(-1.5 - float(torch.rand((), generator=g)))
      elif name.endswith(("input_max", "output_max")):
        p.fill_(1.5 + float(torch.rand((), generator=g)))
  return model


@functools.lru_cache(maxsize=None)
def ours(scan: bool = True):
  model = hf_model()
  flag = f"scan_layers={str(scan).lower()}"
  cfg = replace(our_config(flag), **gemma4_hf_map.config_from_hf(model.config.to_dict()))
  assert cfg == our_config(flag)   # config both ways, the audio tower's keys included
  mcfg = ModelConfig.from_config(cfg)
  return mcfg, make_model_def(mcfg), gemma4_hf_map.hf_to_params(hf_state(model), mcfg)


@functools.lru_cache(maxsize=None)
def prompts():
  """(token rows [2, S], media by transformers' names): row b = text, boi, image b's soft
  tokens, eoi, text, boa, clip b's soft tokens, eoa, text (right-padded to one length)."""
  from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
  processor = Gemma4ImageProcessorPil(patch_size=2, max_soft_tokens=70, pooling_kernel_size=2)
  rng = np.random.default_rng(0)
  images = [rng.integers(0, 256, (24, 40, 3), dtype=np.uint8),
            rng.integers(0, 256, (36, 20, 3), dtype=np.uint8)]
  img = processor(images=images, return_tensors="np")
  fe = transformers.Gemma4AudioFeatureExtractor()
  clips = [(0.1 * rng.standard_normal(int(s * fe.sampling_rate))).astype(np.float32)
           for s in SECONDS]
  aud = fe(clips, return_tensors="np")
  feats = np.asarray(aud["input_features"], np.float32)
  mask = np.asarray(aud["input_features_mask"])
  with torch.no_grad():   # the soft tokens each clip yields: the tower's valid frames
    valid = hf_model().model.get_audio_features(torch.tensor(feats), torch.tensor(mask),
                                                return_dict=True).attention_mask.numpy()
  n_img = [int(n) for n in img["num_soft_tokens_per_image"]]
  n_aud = [int(v.sum()) for v in valid]
  assert n_img[0] != n_img[1] and n_aud[0] != n_aud[1]
  width = max(a + b for a, b in zip(n_img, n_aud)) + 16
  rows = []
  for ni, na in zip(n_img, n_aud):
    text = rng.integers(1, 370, size=width - ni - na - 4)
    rows.append([*text[:5], BOI, *[IMAGE] * ni, EOI, *text[5:9], BOA, *[AUDIO] * na, EOA,
                 *text[9:]])
  media = {"pixel_values": np.asarray(img["pixel_values"], np.float32),
           "image_position_ids": np.asarray(img["image_position_ids"], np.int32),
           "input_features": feats, "input_features_mask": mask}
  return np.asarray(rows, np.int32), media


def token_types(tokens):
  """transformers' mm_token_type_ids: 1 image, 3 audio, 0 text."""
  return (tokens == IMAGE) * 1 + (tokens == AUDIO) * 3


def hf_inputs(tokens, media, b: int, dtype=torch.float32) -> dict:
  return dict(input_ids=torch.tensor(tokens[b:b + 1].astype(np.int64)),
              pixel_values=torch.tensor(media["pixel_values"][b:b + 1]).to(dtype),
              image_position_ids=torch.tensor(media["image_position_ids"][b:b + 1].astype(np.int64)),
              input_features=torch.tensor(media["input_features"][b:b + 1]).to(dtype),
              input_features_mask=torch.tensor(media["input_features_mask"][b:b + 1]),
              mm_token_type_ids=torch.tensor(token_types(tokens[b:b + 1]).astype(np.int64)))


def hf_forward(model, b: int):
  tokens, media = prompts()
  dtype = next(model.parameters()).dtype
  with torch.no_grad():
    return model(**hf_inputs(tokens, media, b, dtype), output_hidden_states=True,
                 use_cache=False)


@functools.lru_cache(maxsize=None)
def forward_program():
  """The jitted forward of `ours()`: (logits, the final norm's output, the captured sites) of a
  batch; one program for every call with the prompts' shapes."""
  from flax import nnx
  mcfg, model_def, _ = ours()
  L = mcfg.num_decoder_layers

  @jax.jit
  def run(params, tokens, media):
    B, S = tokens.shape
    pos, seg = jnp.broadcast_to(jnp.arange(S), (B, S)), jnp.ones((B, S), jnp.int32)
    probe = sites.Probe(L, capture=("embed_out", "resid_post.*"))
    with sites.probing(probe):
      x, _ = model_def.apply_hidden(params, tokens, pos, seg, media=media)
    model = nnx.merge(model_def.graphdef, params)
    return model.logits(x), x, probe.results
  return run


@pytest.fixture(scope="module")
def our_forward():
  """Our logits and every hidden state on the batch of both prompts (one program)."""
  mcfg, _, params = ours()
  tokens, media = prompts()
  L = mcfg.num_decoder_layers
  logits, final, captured = forward_program()(params, tokens, media)
  hidden = [captured["embed_out"], *(captured[f"resid_post.{i}"] for i in range(L - 1)), final]
  return np.asarray(logits), [np.asarray(h) for h in hidden]


def close(got, want, what: str) -> float:
  """|got − want| ≤ 1e-4 of max |want| (transformers' audio attention computes in fp32 whatever
  the model's dtype, so no float64 run of it bounds its own rounding: the plain bound)."""
  err = float(np.abs(got - want).max() / np.abs(want).max())
  assert err <= TOL, (what, err)
  return err


def test_logits_and_hidden_states_with_an_image_and_a_clip_match_hf(our_forward):
  logits, hidden = our_forward
  for b in range(2):
    out = hf_forward(hf_model(), b)
    want = out.logits[0].numpy()
    assert np.abs(want).max() > 1.0
    print(f"row {b}: max|Δlogit| / max|logit| = {close(logits[b], want, f'logits {b}'):.1e}")
    assert len(out.hidden_states) == len(hidden)
    for i, (h_hf, h) in enumerate(zip(out.hidden_states, hidden)):
      close(h[b], h_hf[0].numpy(), f"hidden {i} of row {b}")


def test_audio_is_live(our_forward):
  """The clip changes the logits: the same prompts with silence in place of the clips differ (the
  parity test's program on other features: no second compile)."""
  logits, _ = our_forward
  _, _, params = ours()
  tokens, media = prompts()
  quiet = {**media, "input_features": np.zeros_like(media["input_features"])}
  other = np.asarray(forward_program()(params, tokens, quiet)[0])
  assert np.abs(other - logits).max() > 1e-2


def test_state_dict_round_trip_is_exact():
  mcfg, model_def, params = ours(False)
  sd = hf_state(hf_model())
  assert any(k.startswith("model.audio_tower.layers.1.") for k in sd)
  assert "model.embed_audio.embedding_projection.weight" in sd
  check_round_trip(gemma4_hf_map, mcfg, model_def, params, sd)


def test_hf_to_params_is_strict_about_the_audio_tower():
  """A missing or unknown audio tensor is named; a model read without its audio tower (the
  config's audio_config dropped) skips the tower's tensors."""
  mcfg, _, _ = ours()
  sd = hf_state(hf_model())
  name = "model.audio_tower.output_proj.bias"
  with pytest.raises(ValueError, match=f"lacks {name}"):
    gemma4_hf_map.hf_to_params({k: v for k, v in sd.items() if k != name}, mcfg)
  with pytest.raises(ValueError, match="no place.*model.audio_tower.extra"):
    gemma4_hf_map.hf_to_params({**sd, "model.audio_tower.extra": np.zeros(2)}, mcfg)
  hf = hf_model().config.to_dict()
  vision_only = gemma4_hf_map.config_from_hf({**hf, "audio_config": None})
  assert vision_only["audio_hidden_size"] == 0 and vision_only["vision_layers"] == 2
  audio_only = gemma4_hf_map.config_from_hf({**hf, "vision_config": None})
  assert audio_only["vision_layers"] == 0 and audio_only["audio_hidden_size"] == 32
  cfg = ModelConfig.from_config(replace(our_config(), **vision_only))
  params = gemma4_hf_map.hf_to_params(sd, cfg)
  assert "audio" not in params and "vision" in params


def test_converters_round_trip_with_both_towers_reloads_strictly(tmp_path):
  """HF folder → to_maxtext → to_huggingface → Gemma4ForConditionalGeneration.from_pretrained:
  nothing missing or unexpected, every tensor (both towers and embedders) bit for bit."""
  from MaxText.checkpoint_conversion import to_huggingface, to_maxtext
  model = hf_model()
  model.save_pretrained(tmp_path / "hf")
  cfg = to_maxtext.convert(str(tmp_path / "hf"), str(tmp_path / "ck"), [])
  assert cfg.vision_layers == 2 and cfg.audio_hidden_size == 32 and cfg.audio_num_layers == 2
  assert to_huggingface.export(str(tmp_path / "ck"), str(tmp_path / "out"), 2**30) == "gemma4"
  back, info = transformers.Gemma4ForConditionalGeneration.from_pretrained(
      tmp_path / "out", output_loading_info=True)
  assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
  want, got = hf_state(model), hf_state(back)
  assert got.keys() == want.keys() and any(k.startswith("model.audio_tower.") for k in got)
  for k in want:
    assert np.array_equal(got[k], want[k]), k


def test_greedy_decoding_with_audio_matches_hf_generate():
  """Both prompts (an image and a clip each) in one batch: 40 greedy tokens each equal
  transformers' generate; the towers run once, at the prefill."""
  mcfg, model_def, params = ours()
  tokens, media = prompts()
  got = greedy(mcfg, model_def, params, tokens, media, 40, max_len=192)
  model = hf_model()
  model.generation_config.eos_token_id = None
  for b in range(2):
    with torch.no_grad():
      out = model.generate(**hf_inputs(tokens, media, b), do_sample=False, max_new_tokens=40,
                           pad_token_id=0)
    assert got[b].tolist() == out[0, tokens.shape[1]:].tolist(), b


def test_flops_memory_and_frozen_count_the_audio_tower():
  """FLOPs / MFU count the audio tower's forward over `audio_seconds_per_sequence` (and its
  backward when trained); the memory pre-flight counts its activations; frozen, the tower and its
  embedder are among the family's frozen parameters."""
  from MaxText.models.gemma4 import audio_layers
  from MaxText.models.registry import get_family
  family = get_family("gemma4")
  at = lambda *extra: ModelConfig.from_config(our_config(*extra))
  assert family.flops(at(), 128, True).towers_per_sequence == 0
  D, O, X, K, c0, c1 = 32, 48, 64, 5, 128, 4
  W = audio_layers.context_width(at())
  S = 200.0                               # frames of 2 s; T = S / 4 soft tokens
  T = S / 4
  per_clip = (2 * 9 * c0 * (S / 2) * (c0 / 2) + 2 * 9 * c0 * c1 * T * (c0 / 4)
              + 2 * T * (c0 // 4) * c1 * D
              + 2 * (2 * T * (23 * D * D + K * D) + 2 * T * (2 * W + W // 2 + 1) * D)
              + 2 * T * D * O + 2 * T * O * X)
  frozen = family.flops(at("audio_seconds_per_sequence=2"), 128, True)
  trained = family.flops(at("audio_seconds_per_sequence=2", "freeze_audio_encoder=false"), 128,
                         True)
  assert frozen.towers_per_sequence == pytest.approx(per_clip, rel=1e-12)
  assert trained.towers_per_sequence == pytest.approx(3 * per_clip, rel=1e-12)
  assert family.activation_bytes(at(), 2, 128) == 0
  assert 0 < family.activation_bytes(at("audio_seconds_per_sequence=2"), 2, 128) < \
      family.activation_bytes(at("audio_seconds_per_sequence=2", "freeze_audio_encoder=false"),
                              2, 128)
  assert family.frozen(at()) == ("vision", "embed_vision", "audio", "embed_audio")
  assert family.frozen(at("freeze_audio_encoder=false")) == ("vision", "embed_vision")


def test_published_totals_with_both_towers():
  """E2B and E4B with both towers against their published totals (5.1B and 8B parameters,
  embeddings and towers included; the audio encoder ~300M); their configs convert to
  Gemma4Config and back with the audio config; the larger sizes have no audio tower."""
  import math
  count = lambda tree: sum(math.prod(a.shape) for a in jax.tree.leaves(tree))
  totals = {}
  for name in ("e2b-mm", "e4b-mm", "31b-mm"):
    cfg = load_config([BASE_YML, f"model_name=gemma4-{name}"])
    hf = transformers.Gemma4Config(**gemma4_hf_map.config_to_hf(cfg)).to_dict()
    assert (hf["audio_config"] is None) == (name == "31b-mm")
    back = gemma4_hf_map.config_from_hf(hf)
    assert back == {k: getattr(cfg, k) for k in back}
    if name != "31b-mm":
      params = make_model_def(ModelConfig.from_config(cfg)).abstract_params
      totals[name] = count(params)
      assert 0.29e9 < count(params["audio"]) < 0.31e9
  assert round(totals["e2b-mm"] / 1e9, 1) == 5.1
  assert round(totals["e4b-mm"] / 1e9) == 8


def test_chat_with_a_clip_decodes_as_transformers(tmp_path):
  """The whole path: the tiny model's Hugging Face folder with the processor's files (128 mel
  bins, as its tower takes), a chat message with an audio clip through `MaxText.inference` — the
  prompt ids are apply_chat_template's and 20 greedy tokens equal transformers' generate on the
  processor's tensors."""
  from MaxText import inference
  from test_multimodal_inputs import save_with_processor
  model = hf_model()
  hf_dir = tmp_path / "hf"
  oracle = save_with_processor(model, hf_dir, audio=dict(feature_size=128))
  clip = (0.1 * np.random.default_rng(3).standard_normal(12_000)).astype(np.float32)
  messages = [{"role": "user", "content": [{"type": "audio", "audio": clip},
                                           {"type": "text", "text": "what is this"}]}]
  want = oracle.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                    return_dict=True, return_tensors="pt")
  assert int((want["input_ids"] == AUDIO).sum()) > 0
  ours_ = inference.load([BASE_YML, f"hf_path={hf_dir}", "dtype=float32"], jax.devices()[:1])
  [g] = ours_.generate([{"messages": messages}], max_new_tokens=20, eos_ids=[-1])
  assert g.prompt_ids == want["input_ids"][0].tolist()
  model.generation_config.eos_token_id = None
  with torch.no_grad():
    out = model.generate(**want, do_sample=False, max_new_tokens=20, pad_token_id=0)
  assert g.output_ids == out[0, want["input_ids"].shape[1]:].tolist()
