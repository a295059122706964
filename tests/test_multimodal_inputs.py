"""Images and audio in: our preprocessing (MaxText/data/multimodal/) equals transformers'
`Gemma4Processor` — its image processor (`Gemma4ImageProcessorPil`), its feature extractor and its
placeholder expansion and `mm_token_type_ids` — on images and clips of several sizes, for a batch
call and for chat messages with image / audio parts (ids, masks and token types exactly, pixels
and features within 1e-6); the tools hand exactly those tensors to a model whose family takes
them (a plug-in family: Llama that records what `extend` / `forward_with_aux` receive), a tiny
Gemma 4 with its vision tower decodes a chat message with an image as transformers' generate
does, and a converted checkpoint carries the processor's files. Bad input: an unreadable or non-image file
exits 3 naming it, an image or clip for a text-only model exits 2, more soft tokens than the
positions leave room for exits 2 with the counts. The tiny processor (tokenizer with the
placeholder tokens, chat template, processor configs) is built here; nothing is downloaded."""
import dataclasses
import json
import os
import wave

import jax
import numpy as np
import pytest

from conftest import BASE_YML, MESH_1
from MaxText import decode, inference
from MaxText import inspect as mi
from MaxText.checkpoint import tokenizer_files
from MaxText.checkpoint.manager import save_params_only
from MaxText.config.load import load_config
from MaxText.data.multimodal import audio as audio_lib
from MaxText.data.multimodal.processor import Processor
from MaxText.data.tokenizers import HFTokenizer
from MaxText.models import registry
from MaxText.models.llama import family as llama_family
from MaxText.models.llama.model import Transformer
from MaxText.models.model_config import ModelConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
Gemma4AudioFeatureExtractor = pytest.importorskip(
    "transformers.models.gemma4.feature_extraction_gemma4").Gemma4AudioFeatureExtractor
Gemma4ImageProcessorPil = pytest.importorskip(
    "transformers.models.gemma4.image_processing_pil_gemma4").Gemma4ImageProcessorPil

TOKENS = {"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
          "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>"}
WORDS = ["<pad>", "<eos>", "<bos>", "[UNK]", *TOKENS.values(), "<|video|>", "<start_of_turn>",
         "<end_of_turn>", "user", "model", "what", "is", "this", "hello", "say", "and"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|image|>{% elif p['type'] == 'audio' %}<|audio|>"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %} {% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
IMAGE = dict(patch_size=4, max_soft_tokens=70, pooling_kernel_size=2)
AUDIO = dict(feature_size=16)


class Oracle(transformers.Gemma4Processor):
  """transformers' processor without its video processor (which needs torchvision)."""

  def check_argument_for_proper_class(self, argument_name, argument):
    if argument_name == "video_processor":
      return type(argument)
    return super().check_argument_for_proper_class(argument_name, argument)


def build_processor_folder(folder, layout="processor_config", words=tuple(WORDS), image=None,
                           audio=None):
  """The tiny tokenizer (placeholders, bos added like Gemma's), its chat template and the
  processor's files; returns transformers' processor over the same folder."""
  from tokenizers import Tokenizer, models, pre_tokenizers, processors
  tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.add_special_tokens([w for w in words if w.startswith("<")])
  tok.post_processor = processors.TemplateProcessing(single="<bos> $A",
                                                     special_tokens=[("<bos>", 2)])
  fast = transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
      unk_token="[UNK]", extra_special_tokens=TOKENS)
  fast.chat_template = TEMPLATE
  fast.save_pretrained(folder)
  hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
  image_processor = Gemma4ImageProcessorPil(**(image or IMAGE))
  extractor = Gemma4AudioFeatureExtractor(**(audio or AUDIO))
  plain = lambda d: json.loads(json.dumps(d, default=lambda o: np.asarray(o).tolist()))
  if layout == "processor_config":
    files = {"processor_config.json": {
        "processor_class": "Gemma4Processor", "image_seq_length": 70, "audio_seq_length": 750,
        "image_processor": plain(image_processor.to_dict()),
        "feature_extractor": plain(extractor.to_dict())}}
  else:   # the older layout: both parts' settings in preprocessor_config.json
    files = {"preprocessor_config.json": {**plain(extractor.to_dict()),
                                          **plain(image_processor.to_dict())}}
  for name, content in files.items():
    with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
      json.dump(content, f)
  return Oracle(feature_extractor=extractor, image_processor=image_processor, tokenizer=hf_tok,
                video_processor=object(), chat_template=TEMPLATE, image_seq_length=70)


def save_with_processor(model, folder, **processor):
  """A transformers Gemma4ForConditionalGeneration saved with a word-level tokenizer over its
  vocabulary (the placeholder and marker tokens at the config's ids), the chat template and the
  processor's files (`processor`: build_processor_folder's image= / audio=); returns transformers'
  processor over the folder."""
  c = model.config
  special = {c.boa_token_id: TOKENS["boa_token"], c.eoa_token_index: TOKENS["eoa_token"],
             c.boi_token_id: TOKENS["boi_token"], c.eoi_token_id: TOKENS["eoi_token"],
             c.image_token_id: TOKENS["image_token"], c.video_token_id: "<|video|>",
             c.audio_token_id: TOKENS["audio_token"]}
  rest = [w for w in WORDS if w not in special.values()]
  words = [special.get(i) or (rest[i] if i < len(rest) else f"w{i}")
           for i in range(c.text_config.vocab_size)]
  model.save_pretrained(folder)
  return build_processor_folder(folder, words=tuple(words), **processor)


def write_images(folder):
  """Images of several sizes and modes: resized up, tall and thin, RGBA, grey, already fitting."""
  import PIL.Image
  rng = np.random.default_rng(0)
  shapes = {"rgb.png": (37, 53, 3), "thin.png": (200, 30, 3), "rgba.png": (64, 64, 4),
            "grey.png": (40, 40, 1), "fits.png": (56, 80, 3), "photo.jpg": (90, 70, 3)}
  paths = []
  for name, (h, w, c) in shapes.items():
    pixels = rng.integers(0, 256, (h, w, c), dtype=np.uint8)
    mode = {1: "L", 3: "RGB", 4: "RGBA"}[c]
    PIL.Image.fromarray(pixels[..., 0] if c == 1 else pixels, mode).save(folder / name)
    paths.append(str(folder / name))
  return paths


def clips():
  rng = np.random.default_rng(1)
  return [rng.standard_normal(8000).astype(np.float32) * 0.1,
          rng.standard_normal(20_811) * 0.3,                                 # float64
          rng.uniform(-1, 1, 400).astype(np.float32),
          rng.uniform(-1, 1, 480_000 + 777).astype(np.float32)]              # cut to 30 s


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  path = tmp_path_factory.mktemp("processor")
  oracle = build_processor_folder(path)
  return path, oracle, write_images(path)


def ours(path) -> Processor:
  tok = HFTokenizer(os.path.join(path, "tokenizer.json"))
  processor = Processor.for_tokenizer(tok)
  assert processor is not None
  return processor


def unpadded(batch, key):
  return [[t for t, m in zip(row, mask) if m] for row, mask in zip(batch[key],
                                                                 batch["attention_mask"])]


def check_equal(got: dict, want, n_images: int, n_clips: int):
  if n_images:
    np.testing.assert_allclose(got["pixel_values"], np.asarray(want["pixel_values"]), atol=1e-6,
                               rtol=0)
    np.testing.assert_array_equal(got["image_position_ids"], want["image_position_ids"])
    assert got["pixel_values"].shape[0] == n_images
  if n_clips:
    np.testing.assert_allclose(got["input_features"], np.stack(want["input_features"]),
                               atol=1e-6, rtol=0)
    np.testing.assert_array_equal(got["input_features_mask"],
                                  np.stack(want["input_features_mask"]))


def test_images_and_audio_equal_transformers(folder):
  path, oracle, images = folder
  processor = ours(path)
  # the image processor alone, on every image
  want = oracle.image_processor([transformers.image_utils.load_image(p) for p in images])
  batch = processor.prepare([[processor.ids["image_token"]] * len(images)], [images], [[]])
  check_equal(batch.tensors(), want, len(images), 0)
  assert batch.image_soft_tokens == want["num_soft_tokens_per_image"]
  assert len(set(batch.image_soft_tokens)) > 2 and max(batch.image_soft_tokens) <= 70
  # the feature extractor alone, on clips of several lengths (one over 30 s)
  want = oracle.feature_extractor(clips())
  got, mask = audio_lib.features(clips(), processor.audio)
  check_equal({"input_features": got, "input_features_mask": mask}, want, 0, 4)
  assert mask.shape[1] == (480_000 + 160 - 321) // 160 + 1 and got.dtype == np.float32 and mask.dtype == bool


def test_processor_call_equals_transformers(folder):
  """A batch of two prompts (placeholders in the text, several images and clips): ids, token
  types and tensors as the processor's call gives them."""
  path, oracle, images = folder
  processor = ours(path)
  texts = ["what is <|image|> and <|audio|> this", "<|image|> say <|image|> hello <|audio|>"]
  media_images, media_clips = [[images[0]], [images[1], images[2]]], [clips()[0], clips()[1]]
  want = oracle(text=texts, images=[[transformers.image_utils.load_image(p) for p in row]
                                    for row in media_images], audio=media_clips)
  tok = HFTokenizer(os.path.join(path, "tokenizer.json"))
  ids = [[tok.bos_id, *tok.encode(t)] for t in texts]
  batch = processor.prepare(ids, media_images, [[media_clips[0]], [media_clips[1]]])
  assert batch.input_ids == unpadded(want, "input_ids")
  assert batch.mm_token_type_ids == unpadded(want, "mm_token_type_ids")
  check_equal(batch.tensors(), want, 3, 2)
  assert batch.image_rows == [0, 1, 1] and batch.audio_rows == [0, 1]
  assert sorted(set(batch.mm_token_type_ids[1])) == [0, 1, 3]
  # the older layout (preprocessor_config.json) gives the same
  legacy = path / "legacy"
  legacy.mkdir()
  build_processor_folder(legacy, layout="preprocessor_config")
  again = ours(legacy).prepare(ids, media_images, [[media_clips[0]], [media_clips[1]]])
  assert again.input_ids == batch.input_ids
  check_equal(again.tensors(), want, 3, 2)


# ---- the tools: a model whose family takes images and audio -------------------------------------
SEEN: list = []


class SeeingLlama(Transformer):
  """Llama that records the image / audio tensors handed to it (the plumbing's end)."""

  def extend(self, tokens_BS, positions_BS, valid_BS, cache, *, prefill, media=None):
    if media:
      jax.debug.callback(lambda m: SEEN.append(jax.tree.map(np.asarray, m)), media)
    return super().extend(tokens_BS, positions_BS, valid_BS, cache, prefill=prefill)

  def forward_with_aux(self, tokens_BS, positions_BS, segment_ids_BS, *, return_hidden=False,
                       media=None):
    if media:
      jax.debug.callback(lambda m: SEEN.append(jax.tree.map(np.asarray, m)), media)
    return super().forward_with_aux(tokens_BS, positions_BS, segment_ids_BS,
                                    return_hidden=return_hidden)


SEEING_LLAMA = dataclasses.replace(llama_family.FAMILY, name="seeing_llama", build=SeeingLlama,
                                   keys=None, media=lambda mcfg: frozenset({"image", "audio"}))
TINY = ["model_name=qwen3-tiny", "hf_model_type=", "num_decoder_layers=1", "vocab_size=32",
        "max_position_embeddings=512"]


@pytest.fixture(scope="module")
def checkpoints(folder, tmp_path_factory):
  """{decoder_block: a checkpoint carrying the tiny tokenizer and processor}: one that takes
  images and audio, one text-only. `seeing_llama` is registered while this file's tests that
  read these run (`registry.registered`: gone for the next test file)."""
  with registry.registered(SEEING_LLAMA):
    yield _checkpoints(folder, tmp_path_factory)


def _checkpoints(folder, tmp_path_factory):
  path, _, _ = folder
  out = {}
  for block in ("seeing_llama", "llama"):
    cfg = load_config([BASE_YML, *TINY, f"decoder_block={block}"])
    ckpt = str(tmp_path_factory.mktemp("ckpt") / block)
    save_params_only(ckpt, jax.device_get(registry.init_params(ModelConfig.from_config(cfg), 0)),
                     cfg.as_dict(), tokenizer=tokenizer_files.files_of(str(path)))
    out[block] = ckpt
  return out


def test_checkpoint_carries_the_processor(folder, checkpoints, tmp_path):
  path, _, _ = folder
  step = os.path.join(checkpoints["seeing_llama"], "0")
  assert {"processor_config.json", "tokenizer.json"} <= set(
      tokenizer_files.files_of(os.path.join(step, "tokenizer")))
  assert "processor_config.json" in tokenizer_files.export(step, str(tmp_path))


def test_decode_hands_the_processors_tensors_to_the_model(folder, checkpoints, tmp_path,
                                                         monkeypatch):
  """Chat messages with an image path and an audio array: the ids are transformers'
  apply_chat_template's, and the model's prefill receives exactly its tensors; `image=` on the
  command line as well."""
  path, oracle, images = folder
  model = inference.load([BASE_YML, f"load_parameters_path={checkpoints['seeing_llama']}"],
                         jax.devices()[:1])
  clip = clips()[2]
  messages = [{"role": "user", "content": [
      {"type": "image", "image": images[3]}, {"type": "text", "text": "what is this"},
      {"type": "audio", "audio": clip}]}]
  want = oracle.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                    return_dict=True)
  SEEN.clear()
  [g] = model.generate([{"messages": messages}], max_new_tokens=3)
  assert g.prompt_ids == want["input_ids"][0]
  [seen] = SEEN
  check_equal(seen, want, 1, 1)
  prepared = model.prepare([{"messages": messages}])
  assert prepared.mm_token_type_ids == [list(want["mm_token_type_ids"][0])]
  # the same through the command line: a text prompt with image=, rendered as chat
  out = tmp_path / "out.jsonl"
  SEEN.clear()   # one device: the recording callback inside an 8-device program would stall it
  monkeypatch.setattr(decode, "load", lambda argv: inference.load(argv, jax.devices()[:1]))
  assert decode.main([BASE_YML, *MESH_1, f"load_parameters_path={checkpoints['seeing_llama']}",
                      "prompt=what is this", "chat=true", f"image={images[0]}",
                      f"image={images[1]}", "max_new_tokens=2", f"decode_output={out}"]) == 0
  line = json.loads(open(out, encoding="utf-8").read())
  parts = [{"type": "image", "image": images[0]}, {"type": "image", "image": images[1]},
           {"type": "text", "text": "what is this"}]
  want = oracle.apply_chat_template([{"role": "user", "content": parts}],
                                    add_generation_prompt=True, tokenize=True, return_dict=True)
  assert line["prompt_ids"] == want["input_ids"][0]
  check_equal(SEEN[0], want, 2, 0)


def test_tensors_by_transformers_names_and_the_trace(folder, checkpoints):
  """The processor's own tensors as keyword arguments (ids already expanded): the model gets them
  as they are; the inspection Trace carries mm_token_type_ids and each image's patch grid."""
  path, oracle, images = folder
  m = mi.load(load_parameters_path=checkpoints["seeing_llama"], overrides=["dtype=float32"],
              devices=jax.devices()[:1])
  want = oracle(text=["what is <|image|> this <|image|>"],
                images=[[transformers.image_utils.load_image(p) for p in images[4:6]]],
                return_tensors="np")
  ids = [int(t) for t in want["input_ids"][0]]
  SEEN.clear()
  trace = m.forward(ids, capture={"logits"}, pixel_values=want["pixel_values"],
                    image_position_ids=want["image_position_ids"])
  [seen] = SEEN
  np.testing.assert_array_equal(seen["pixel_values"], want["pixel_values"])
  np.testing.assert_array_equal(trace.mm_token_type_ids, want["mm_token_type_ids"][0])
  assert list(trace.token_types()[trace.mm_token_type_ids == 1]) == \
      ["image"] * int((want["mm_token_type_ids"][0] == 1).sum())
  grids = [(int(p[:, 1].max()) + 1, int(p[:, 0].max()) + 1) for p in want["image_position_ids"]]
  assert trace.image_grids == grids == [(14, 20), (18, 14)]
  assert trace.arrays()["image_grids"].tolist() == [list(g) for g in grids]
  # files instead of tensors: the same trace
  again = m.forward("what is <|image|> this <|image|>", capture={"logits"}, images=images[4:6])
  np.testing.assert_array_equal(again.tokens, trace.tokens)
  np.testing.assert_allclose(again.logits, trace.logits, atol=1e-6)
  with pytest.raises(inference.InferenceError, match="prompt 0 holds"):
    m.forward(ids[:-3], capture={"logits"}, pixel_values=want["pixel_values"],
              image_position_ids=want["image_position_ids"])


def write_wav(path, samples_int16, rate=16000):
  with wave.open(str(path), "wb") as w:
    w.setnchannels(1)
    w.setsampwidth(2)
    w.setframerate(rate)
    w.writeframes(samples_int16.astype("<i2").tobytes())


def test_wav_files_read_as_soundfile_does(tmp_path):
  samples = np.array([0, 1, -1, 32767, -32768, 1234], np.int16)
  write_wav(tmp_path / "a.wav", samples)
  got = audio_lib.read_wav(str(tmp_path / "a.wav"), 16000)
  np.testing.assert_array_equal(got, samples.astype(np.float32) / 32768)
  write_wav(tmp_path / "b.wav", samples, rate=44100)
  with pytest.raises(audio_lib.MediaError, match="44100 Hz"):
    audio_lib.read_wav(str(tmp_path / "b.wav"), 16000)


def test_bad_media_exit_codes(folder, checkpoints, tmp_path, capsys, monkeypatch):
  path, _, images = folder
  (tmp_path / "notes.png").write_text("not an image")
  write_wav(tmp_path / "clip.wav", np.zeros(1600, np.int16))
  text_only = f"load_parameters_path={checkpoints['llama']}"
  seeing = f"load_parameters_path={checkpoints['seeing_llama']}"
  cases = [  # (arguments, exit status, what the message names)
      ([seeing, "prompt=hello", f"image={tmp_path / 'notes.png'}"], 3, "notes.png"),
      ([seeing, "prompt=hello", f"image={tmp_path / 'gone.png'}"], 3, "gone.png does not exist"),
      ([seeing, "prompt=hello", f"audio={tmp_path / 'notes.png'}"], 3, "cannot be read as a WAV"),
      ([text_only, "prompt=hello", f"image={images[0]}"], 2, "has no vision tower"),
      ([text_only, "prompt=hello", f"audio={tmp_path / 'clip.wav'}"], 2, "has no audio tower"),
      ([seeing, "prompt=hello", f"image={images[4]}", "max_cache_length=64"], 2,
       "prompt 0: 4 text tokens + 70 image soft tokens (1 image(s)) + 0 audio soft tokens "
       "(0 clip(s)) = 74 positions + max_new_tokens=4 overflow max_cache_length (64)"),
  ]
  monkeypatch.setattr(decode, "load", lambda argv: inference.load(argv, jax.devices()[:1]))
  for args, status, message in cases:
    assert decode.main([BASE_YML, *MESH_1, *args, "max_new_tokens=4"]) == status, args
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, (args, err)


def test_gemma4_with_its_vision_tower_decodes_an_image_as_transformers(folder, tmp_path):
  """The whole path on a tiny random Gemma4ForConditionalGeneration (tests/test_gemma4_vision.py):
  its Hugging Face folder with the processor's files, a chat message with an image through
  `MaxText.inference` — the prompt ids are apply_chat_template's and 20 greedy tokens equal
  transformers' generate on the processor's tensors."""
  from test_gemma4_vision import hf_model
  model = hf_model()
  hf_dir = tmp_path / "hf"
  oracle = save_with_processor(model, hf_dir, image=dict(patch_size=2, max_soft_tokens=70,
                                                        pooling_kernel_size=2))
  _, _, images = folder
  messages = [{"role": "user", "content": [{"type": "image", "image": images[0]},
                                           {"type": "text", "text": "what is this"}]}]
  want = oracle.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                    return_dict=True, return_tensors="pt")
  ours_ = inference.load([BASE_YML, f"hf_path={hf_dir}", "dtype=float32"], jax.devices()[:1])
  [g] = ours_.generate([{"messages": messages}], max_new_tokens=20, eos_ids=[-1])
  assert g.prompt_ids == want["input_ids"][0].tolist()
  model.generation_config.eos_token_id = None
  with torch.no_grad():
    out = model.generate(**want, do_sample=False, max_new_tokens=20, pad_token_id=0)
  assert g.output_ids == out[0, want["input_ids"].shape[1]:].tolist()
  # the inspection forward takes every tensor the processor returns (`**processor(...)`): the
  # prompt from input_ids, mm_token_type_ids checked against what the placeholders imply; its
  # logits are transformers' on the same tensors
  from MaxText.inspect.model import Inspector
  batch = {k: v.numpy() for k, v in want.items()}
  assert set(batch) == {"input_ids", "attention_mask", "mm_token_type_ids", "pixel_values",
                        "image_position_ids"}
  m = Inspector(ours_)
  trace = m.forward(capture={"logits"}, **batch)
  with torch.no_grad():
    hf_logits = model(**want).logits[0].numpy()
  np.testing.assert_allclose(trace.logits, hf_logits, atol=2e-4, rtol=0)
  np.testing.assert_array_equal(trace.mm_token_type_ids, batch["mm_token_type_ids"][0])
  np.testing.assert_array_equal(trace.tokens, batch["input_ids"][0])
  again = m.forward(g.prompt_ids, capture={"logits"}, **batch)   # the ids given as well
  np.testing.assert_array_equal(again.logits, trace.logits)
  types = batch["mm_token_type_ids"].copy()
  types[0, int(np.argmax(types[0] == 1))] = 0                    # an image token called text
  for wrong, says in ((dict(mm_token_type_ids=types), "mm_token_type_ids row 0 differs"),
                      (dict(input_ids=batch["input_ids"][:, ::-1]), "input_ids row 0 differs"),
                      (dict(attention_mask=batch["attention_mask"][:, 1:]), "differ in shape")):
    with pytest.raises(inference.InferenceError, match=says):
      m.forward(g.prompt_ids, capture={"logits"}, **{**batch, **wrong})
