"""Gemma 4 with its vision tower against transformers' `Gemma4ForConditionalGeneration` (the
oracle): a tiny random model (fp32, eager attention) built from our config through
gemma4_hf_map.config_to_hf — text: sliding + full layers (window 8, shorter than an image's run of
soft tokens), a kv-shared tail, PLE, bidirectional attention among an image's tokens; vision: 2
layers, 2-D RoPE, 2×2 pooling, standardization, clipped linears with finite bounds. Norm weights,
the position table, the standardization buffers and the layer scalars are perturbed.

Two prompts with one image each, of different sizes (60 and 66 soft tokens), as transformers'
own image processor (`Gemma4ImageProcessorPil`) gives them: our batch of both against transformers
run on each prompt (logits and every hidden state within 1e-4 of their largest magnitude); the
state-dict round trip bitwise; the converters' round trip (to_maxtext → to_huggingface) reloaded
strictly; greedy decoding (a prefill with the image, then steps over the cache) against
transformers' generate (40 tokens); the FLOP, memory and frozen counts of the tower."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import BASE_YML  # noqa: E402
from hf_parity import check_round_trip, hf_state  # noqa: E402
from MaxText.config.load import load_config, replace  # noqa: E402
from MaxText.layers import sites  # noqa: E402
from MaxText.models.gemma4 import gemma4_hf_map  # noqa: E402
from MaxText.models.model_config import ModelConfig  # noqa: E402
from MaxText.models.registry import make_model_def  # noqa: E402

TOL = 1e-4
IMAGE, BOI, EOI = 380, 378, 379
OVERRIDES = [   # configs/models/gemma4-mm-tiny.yml, with a shorter text model
    "model_name=gemma4-mm-tiny", "attention_pattern=sf", "num_decoder_layers=4",
    "num_kv_shared_layers=2", "sliding_window=8",
]


def our_config(*extra: str):
  return load_config([BASE_YML, *OVERRIDES, *extra])


@functools.lru_cache(maxsize=None)
def hf_model():
  hf = gemma4_hf_map.config_to_hf(our_config())
  hf["text_config"]["initializer_range"] = 0.2
  hf["vision_config"]["initializer_range"] = 0.2
  config = transformers.Gemma4Config(**hf, attn_implementation="eager")
  torch.manual_seed(0)
  model = transformers.Gemma4ForConditionalGeneration(config).float().eval()
  g = torch.Generator().manual_seed(1)
  with torch.no_grad():
    for name, p in [*model.named_parameters(), *model.named_buffers()]:
      if name.endswith(("norm.weight", "layer_scalar", "std_scale", "position_embedding_table")):
        p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
      elif name.endswith("std_bias"):
        p.copy_(0.3 * torch.randn(p.shape, generator=g))
      elif name.endswith(("input_min", "output_min")):   # finite bounds that clip some values
        p.fill_(-1.5 - float(torch.rand((), generator=g)))
      elif name.endswith(("input_max", "output_max")):
        p.fill_(1.5 + float(torch.rand((), generator=g)))
  return model


@functools.lru_cache(maxsize=None)
def ours(scan: bool = True):
  model = hf_model()
  cfg = replace(our_config(f"scan_layers={str(scan).lower()}"),
                **gemma4_hf_map.config_from_hf(model.config.to_dict()))
  assert cfg == our_config(f"scan_layers={str(scan).lower()}")   # config both ways
  mcfg = ModelConfig.from_config(cfg)
  return mcfg, make_model_def(mcfg), gemma4_hf_map.hf_to_params(hf_state(model), mcfg)


@functools.lru_cache(maxsize=None)
def prompts():
  """(token rows [2, S] of equal length, pixel_values [2, P, C], image_position_ids [2, P, 2]):
  row b = text, boi, image b's soft tokens, eoi, text."""
  from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
  processor = Gemma4ImageProcessorPil(patch_size=2, max_soft_tokens=70, pooling_kernel_size=2)
  rng = np.random.default_rng(0)
  images = [rng.integers(0, 256, (24, 40, 3), dtype=np.uint8),
            rng.integers(0, 256, (36, 20, 3), dtype=np.uint8)]
  out = processor(images=images, return_tensors="np")
  counts = [int(n) for n in out["num_soft_tokens_per_image"]]
  assert counts[0] != counts[1]
  width = max(counts) + 12
  rows = []
  for n in counts:
    text = rng.integers(1, 370, size=width - n - 2)
    rows.append([*text[:5], BOI, *[IMAGE] * n, EOI, *text[5:]])
  return (np.asarray(rows, np.int32), np.asarray(out["pixel_values"], np.float32),
          np.asarray(out["image_position_ids"], np.int32))


@functools.lru_cache(maxsize=None)
def hf_model64():
  import copy
  return copy.deepcopy(hf_model()).double()


def hf_forward(tokens, pixels, positions, model=None):
  model = model or hf_model()
  dtype = next(model.parameters()).dtype
  with torch.no_grad():
    return model(input_ids=torch.tensor(tokens[None].astype(np.int64)),
                 pixel_values=torch.tensor(pixels[None]).to(dtype),
                 image_position_ids=torch.tensor(positions[None].astype(np.int64)),
                 mm_token_type_ids=torch.tensor((tokens[None] == IMAGE).astype(np.int64)),
                 output_hidden_states=True, use_cache=False)


@functools.lru_cache(maxsize=None)
def forward_program():
  """The jitted forward of `ours()`: (logits, the final norm's output, the captured sites) of a
  batch; one program for every call with the prompts' shapes."""
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
  """Our logits and every hidden state (embed_out, resid_post of each layer, the final norm's
  output) on the batch of both prompts."""
  mcfg, _, params = ours()
  tokens, pixels, positions = prompts()
  L = mcfg.num_decoder_layers
  media = {"pixel_values": pixels, "image_position_ids": positions}
  logits, final, captured = forward_program()(params, tokens, media)
  hidden = [captured["embed_out"], *(captured[f"resid_post.{i}"] for i in range(L - 1)), final]
  return np.asarray(logits), [np.asarray(h) for h in hidden]


def within(got, want, exact, what) -> float:
  """|got − want| ≤ 1e-4 of max |want|, or (when transformers' own fp32 error, against its float64
  run `exact`, is the larger part) twice that error: a deep random model amplifies rounding at the
  image's positions, and the order of fp32 sums is the CPU's. Ours must also be within 1e-4 of the
  exact values, so a bug of ours cannot hide behind the bound."""
  scale = np.abs(want).max()
  err, own = np.abs(got - want).max(), np.abs(want - exact).max()
  assert np.abs(got - exact).max() <= TOL * scale, (what, np.abs(got - exact).max(), scale)
  assert err <= max(TOL * scale, 2 * own), (what, err, own, scale)
  return err / scale


def test_logits_and_hidden_states_match_hf(our_forward):
  logits, hidden = our_forward
  tokens, pixels, positions = prompts()
  for b in range(2):
    out, exact = (hf_forward(tokens[b], pixels[b], positions[b], m)
                  for m in (hf_model(), hf_model64()))
    want = out.logits[0].numpy()
    assert np.abs(want).max() > 1.0
    rel = within(logits[b], want, exact.logits[0].numpy(), f"logits {b}")
    print(f"row {b}: max|Δlogit| / max|logit| = {rel:.1e}")
    assert len(out.hidden_states) == len(hidden)
    for i, (h_hf, h64, h) in enumerate(zip(out.hidden_states, exact.hidden_states, hidden)):
      within(h[b], h_hf[0].numpy(), h64[0].numpy(), f"hidden {i} of row {b}")


def test_images_are_live(our_forward):
  """The image changes the logits (black images in its place, through the parity test's program:
  no second compile), and its tokens attend both ways: causal attention among them (transformers
  without mm_token_type_ids) moves them, so the parity above covers both."""
  logits, _ = our_forward
  tokens, pixels, positions = prompts()
  with torch.no_grad():
    causal = hf_model()(input_ids=torch.tensor(tokens[:1].astype(np.int64)),
                        pixel_values=torch.tensor(pixels[:1]),
                        image_position_ids=torch.tensor(positions[:1].astype(np.int64)),
                        use_cache=False).logits[0].numpy()
  assert np.abs(causal - logits[0]).max() > 1e-2
  _, _, params = ours()
  black = {"pixel_values": np.zeros_like(pixels), "image_position_ids": positions}
  other = np.asarray(forward_program()(params, tokens, black)[0])
  assert np.abs(other - logits).max(axis=(1, 2)).min() > 1e-2          # each row's image


def test_sharded_forward_equals_one_device(our_forward):
  """On 8 devices (data 2 x fsdp 2 x tensor 2) the tower's parameters shard by their own logical
  axes as the text model's (width over fsdp, heads and MLP over tensor), the images over data; the
  logits equal one device's within fp32 rounding."""
  from MaxText.sharding.mesh import create_mesh
  from MaxText.sharding.rules import parse_rules, tree_shardings, use_rules
  cfg = load_config([BASE_YML, "ici_data_parallelism=2", "ici_fsdp_parallelism=2",
                     "ici_tensor_parallelism=2"])
  mesh = create_mesh(cfg, jax.devices())
  rules = parse_rules(cfg.logical_axis_rules, cfg.mesh_axes)
  mcfg, model_def, params = ours()
  shardings = tree_shardings(model_def.logical_axes, model_def.abstract_params, mesh, rules)
  q = shardings["vision"]["encoder"]["runs"][0][0]["attn"]["query"]["kernel"].spec
  up = shardings["vision"]["encoder"]["runs"][0][0]["mlp"]["up"]["kernel"].spec
  # (the stacked layers' axis: the `stage` rule, of size 1 here)
  assert tuple(q) == ("stage", "fsdp", "tensor", None) and tuple(up) == ("stage", "fsdp", "tensor")
  tokens, pixels, positions = prompts()
  B, S = tokens.shape

  @jax.jit
  def run(params, tokens, media):
    with use_rules(mesh, rules):
      return model_def.apply(params, tokens, jnp.broadcast_to(jnp.arange(S), (B, S)),
                             jnp.ones((B, S), jnp.int32), media=media)

  got = np.asarray(run(jax.device_put(params, shardings), tokens,
                       {"pixel_values": pixels, "image_position_ids": positions}))
  want = our_forward[0]
  # the tensor-parallel sums add in another order; at the image's positions this deep random model
  # amplifies fp32 rounding (as it does transformers' own fp32 logits against float64)
  assert np.abs(got - want).max() <= TOL * np.abs(want).max()


@pytest.mark.parametrize("scan", [True, False])
def test_state_dict_round_trip_is_exact(scan):
  mcfg, model_def, params = ours(scan)
  sd = hf_state(hf_model())
  assert any(k.startswith("model.vision_tower.encoder.layers.1.") for k in sd)
  assert "model.embed_vision.embedding_projection.weight" in sd
  check_round_trip(gemma4_hf_map, mcfg, model_def, params, sd)


def test_hf_to_params_is_strict_about_the_tower():
  """A missing or unknown tower tensor is named; a tower the config lacks (audio here) is skipped;
  without vision_config the checkpoint is read as its text model; the unsupported bidirectional
  mode and media no tower reads are refused."""
  from MaxText.models.gemma4 import towers
  mcfg, _, params = ours()
  sd = hf_state(hf_model())
  missing = {k: v for k, v in sd.items() if k != "model.vision_tower.std_bias"}
  with pytest.raises(ValueError, match="lacks model.vision_tower.std_bias"):
    gemma4_hf_map.hf_to_params(missing, mcfg)
  with pytest.raises(ValueError, match="no place.*model.vision_tower.extra"):
    gemma4_hf_map.hf_to_params({**sd, "model.vision_tower.extra": np.zeros(2)}, mcfg)
  audio = {**sd, "model.audio_tower.layers.0.x": np.zeros(2), "model.embed_audio.y": np.zeros(2)}
  jax.tree.map(np.testing.assert_array_equal, gemma4_hf_map.hf_to_params(audio, mcfg), params)
  hf = hf_model().config.to_dict()
  text = gemma4_hf_map.config_from_hf({**hf, "vision_config": None})
  assert text["hf_model_type"] == "gemma4_text" and "vision_layers" not in text
  bad = {**hf, "text_config": {**hf["text_config"], "use_bidirectional_attention": "all"}}
  with pytest.raises(ValueError, match="use_bidirectional_attention='all'"):
    gemma4_hf_map.config_from_hf(bad)
  with pytest.raises(ValueError, match=r"media inputs \['input_features'\].*\(vision\)"):
    towers.check_media(mcfg, {"input_features": np.zeros(1)})


def test_converters_round_trip_reloads_strictly(tmp_path):
  """HF folder → to_maxtext → to_huggingface → Gemma4ForConditionalGeneration.from_pretrained:
  nothing missing or unexpected, every tensor (towers and embedders included) bit for bit."""
  from MaxText.checkpoint_conversion import to_huggingface, to_maxtext
  model = hf_model()
  model.save_pretrained(tmp_path / "hf")
  cfg = to_maxtext.convert(str(tmp_path / "hf"), str(tmp_path / "ck"), [])
  assert cfg.hf_model_type == "gemma4" and cfg.vision_layers == 2
  assert to_huggingface.export(str(tmp_path / "ck"), str(tmp_path / "out"), 2**30) == "gemma4"
  back, info = transformers.Gemma4ForConditionalGeneration.from_pretrained(
      tmp_path / "out", output_loading_info=True)
  assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
  want, got = hf_state(model), hf_state(back)
  assert got.keys() == want.keys()
  for k in want:
    assert np.array_equal(got[k], want[k]), k


def greedy(mcfg, model_def, params, tokens, media, steps: int, max_len: int = 128):
  """Greedy decoding through the family's decoding interface: one prefill (`extend(prefill=True,
  media=...)`: the soft tokens computed once) into an empty cache, then `steps - 1` one-token
  `extend` steps that read only the cache."""
  from MaxText.decoding import cache as cache_lib
  B, S = tokens.shape
  specs = cache_lib.specs(mcfg, B, max_len, jnp.float32)

  @jax.jit
  def prefill(params, tokens, media):
    model = nnx.merge(model_def.graphdef, params)
    positions = jnp.broadcast_to(jnp.arange(S), (B, S))
    x, cache = model.extend(tokens, positions, jnp.ones((B, S), bool), cache_lib.empty(specs),
                            prefill=True, media=media)
    return jnp.argmax(model.logits(x[:, -1:])[:, 0], -1), cache

  @jax.jit
  def step(params, token, position, cache):
    model = nnx.merge(model_def.graphdef, params)
    x, cache = model.extend(token[:, None], position[:, None], jnp.ones((B, 1), bool), cache,
                            prefill=False)
    return jnp.argmax(model.logits(x)[:, 0], -1), cache

  token, cache = prefill(params, tokens, media)
  out = [token]
  for i in range(steps - 1):
    token, cache = step(params, token, jnp.full((B,), S + i), cache)
    out.append(token)
  return np.stack([np.asarray(t) for t in out], axis=1)


def test_greedy_decoding_with_an_image_matches_hf_generate():
  """Both prompts in one batch: 40 greedy tokens each equal transformers' generate."""
  mcfg, model_def, params = ours()
  tokens, pixels, positions = prompts()
  got = greedy(mcfg, model_def, params, tokens,
               {"pixel_values": pixels, "image_position_ids": positions}, 40)
  model = hf_model()
  model.generation_config.eos_token_id = None
  for b in range(2):
    with torch.no_grad():
      out = model.generate(input_ids=torch.tensor(tokens[b:b + 1].astype(np.int64)),
                           pixel_values=torch.tensor(pixels[b:b + 1]),
                           image_position_ids=torch.tensor(positions[b:b + 1].astype(np.int64)),
                           mm_token_type_ids=torch.tensor(
                               (tokens[b:b + 1] == IMAGE).astype(np.int64)),
                           do_sample=False, max_new_tokens=40, pad_token_id=0)
    assert got[b].tolist() == out[0, tokens.shape[1]:].tolist(), b

def test_flops_memory_and_frozen_count_the_tower():
  """FLOPs / MFU count the tower's forward over `images_per_sequence` padded images (and its
  backward when trained); the memory pre-flight counts its activations; frozen, the tower and its
  embedder are the family's frozen parameters."""
  from MaxText.metrics.flops import training_flops_per_step
  from MaxText.models.registry import get_family
  family = get_family("gemma4")
  at = lambda *extra: ModelConfig.from_config(our_config(*extra))
  assert family.flops(at(), 128, True).towers_per_sequence == 0
  P, M, Dv, F, D = 70 * 4, 70, 32, 64, 64            # patches, soft tokens, widths (tiny config)
  per_image = (2 * P * (3 * 2 * 2 * Dv + 2 * (4 * Dv * Dv + 3 * Dv * F))
               + 2 * 4 * P * P * 2 * 16 + 2 * M * Dv * D)
  frozen = family.flops(at("images_per_sequence=2"), 128, True)
  trained = family.flops(at("images_per_sequence=2", "freeze_vision_encoder=false"), 128, True)
  assert frozen.towers_per_sequence == 2 * per_image
  assert trained.towers_per_sequence == 3 * frozen.towers_per_sequence
  step = training_flops_per_step(frozen, seq_len=128, global_batch=4)
  assert step["towers"] == 4 * 2 * per_image and step["total"] == pytest.approx(
      step["matmul"] + step["attention"] + step["towers"])
  assert family.activation_bytes(at(), 2, 128) == 0
  assert 0 < family.activation_bytes(at("images_per_sequence=2"), 2, 128) < \
      family.activation_bytes(at("images_per_sequence=2", "freeze_vision_encoder=false"), 2, 128)
  assert family.frozen(at()) == ("vision", "embed_vision")
  assert family.frozen(at("freeze_vision_encoder=false")) == ()


def test_published_vision_towers():
  """The released sizes' vision towers: the 31B's is 569,550,384 parameters without its embedder
  (the count published with the tower extracted from google/gemma-4-31B-it); every -mm config
  converts to Gemma4Config and back."""
  import math
  cfg = load_config([BASE_YML, "model_name=gemma4-31b-mm"])
  params = make_model_def(ModelConfig.from_config(cfg)).abstract_params
  assert sum(math.prod(a.shape) for a in jax.tree.leaves(params["vision"])) == 569_550_384
  for name in ("e2b-mm", "e4b-mm", "26b-a4b-mm", "31b-mm"):
    cfg = load_config([BASE_YML, f"model_name=gemma4-{name}"])
    assert gemma4_hf_map.config_from_hf(transformers.Gemma4Config(
        **gemma4_hf_map.config_to_hf(cfg)).to_dict()) == {
            k: getattr(cfg, k) for k in gemma4_hf_map.config_from_hf(
                gemma4_hf_map.config_to_hf(cfg))}
    small = name in ("e2b-mm", "e4b-mm")
    assert (cfg.vision_emb_dim, cfg.vision_clipped_linears, cfg.mm_bidirectional_vision) == (
        (768, True, False) if small else (1152, False, True))
