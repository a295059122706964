"""SFT on chat records with images and audio (MaxText/data/media_rows.py) for the tiny Gemma 4 with
both towers of tests/test_gemma4_mm_audio.py (one layer of each kind: `SMALL`), converted with its
processor's files: a conversation's rows equal transformers' processor on the same chat (ids; the
loss on the assistant's tokens only); a few steps with the vision tower trained on 1 device equal
8 devices (fsdp 4 x tensor 2) within 1e-5 in fp32; the trained vision tower moves while the frozen
audio tower stays bit-identical; bad media records and settings are refused naming the key."""
import json
import os

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import CACHE_DIR, ROOT, argv, read_metrics  # noqa: E402
from test_gemma4_mm_audio import BOI, EOI, IMAGE, hf_model  # noqa: E402
from test_multimodal_inputs import TEMPLATE, save_with_processor, write_wav  # noqa: E402
from MaxText.data.bad_records import BadRecord  # noqa: E402

# the processor tests' template with Gemma's turn names (the assistant's turn is "model")
GEMMA_TEMPLATE = TEMPLATE.replace("{{ m['role'] }}",
                                  "{{ 'model' if m['role'] == 'assistant' else m['role'] }}")

SFT_YML = os.path.join(ROOT, "configs", "sft.yml")
ANSWERS = ["hello", "say hello", "and this", "what is this", "hello and hello", "this is",
           "say this", "is this"]


# test_gemma4_mm_audio.py's model with one layer where it has more: a sliding and a full text layer
# (no K/V-sharing ones), one vision and one audio layer. What this file checks is the media rows,
# the trained and the frozen tower and their sharding on 8 devices, not the depth (each kind of
# layer: the parity tests); the programs of 1 and 8 devices are this file's costliest.
SMALL = ("num_decoder_layers=2", "num_kv_shared_layers=0", "vision_layers=1", "audio_num_layers=1")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  """(work dir, converted checkpoint, the chat jsonl, transformers' processor)."""
  import PIL.Image
  from MaxText.checkpoint_conversion import to_maxtext
  d = tmp_path_factory.mktemp("sft_media")
  oracle = save_with_processor(hf_model(*SMALL), d / "hf",
                               image=dict(patch_size=2, max_soft_tokens=70, pooling_kernel_size=2),
                               audio=dict(feature_size=128))
  to_maxtext.convert(str(d / "hf"), str(d / "ck"), [])
  rng = np.random.default_rng(0)
  records = []
  for i, answer in enumerate(ANSWERS):
    image = f"img{i}.png"
    h, w = [(24, 40), (36, 20), (30, 30), (16, 44)][i % 4]
    PIL.Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(d / image)
    content = [{"type": "image", "image": image}, {"type": "text", "text": "what is this"}]
    if i % 2:
      clip = f"clip{i}.wav"
      write_wav(d / clip, (rng.standard_normal(4000 + 1000 * i) * 3000).astype(np.int16))
      content.append({"type": "audio", "audio": clip})
    records.append({"messages": [{"role": "user", "content": content},
                                 {"role": "assistant", "content": answer}]})
  (d / "chat.jinja").write_text(GEMMA_TEMPLATE)
  with open(d / "chat.jsonl", "w", encoding="utf-8") as f:
    for r in records:
      f.write(json.dumps(r) + "\n")
  return d, d / "ck", d / "chat.jsonl", oracle


def sft_argv(d, run_name, *extra):
  """configs/sft.yml with the converted model, the chat data and its media slots; a later value of
  a key replaces an earlier one."""
  return argv(d, run_name, f"load_parameters_path={d / 'ck'}",
              f"dataset_path={d / 'chat.jsonl'}", "packing=false",
              "max_num_images_per_example=1", "max_num_audio_per_example=1",
              "max_audio_seconds=1", "max_target_length=128", "dtype=float32",
              "weight_dtype=float32", "steps=3", "warmup_steps=0", "learning_rate=1e-2",
              # adam_eps=1: each update is linear in its gradient near zero (with the default
              # 1e-8 a gradient at rounding level flips its sign, and the comparison of 1 and 8
              # devices would measure that rather than the training step)
              "adam_eps=1",
              "enable_checkpointing=false", "sample_at_end=false", "shuffle=false",
              f"jax_cache_dir={CACHE_DIR}",
              f"chat_template_path={d / 'chat.jinja'}", *extra, config=SFT_YML, model=())


def _chat_to_pairs(setup, *extra):
  """(the media slots, the data pipeline's chat → row stage) of `sft_argv(..., *extra)`."""
  from MaxText.config.load import load_config
  from MaxText.data import sft
  from MaxText.data.config import DataConfig
  from MaxText.data.multimodal.processor import Processor
  from MaxText.data.pipeline import media_slots
  from MaxText.data.tokenizers import HFTokenizer
  d, ck = setup[0], setup[1]
  tok_path = os.path.join(ck, "0", "tokenizer", "tokenizer.json")
  tokenizer = HFTokenizer(tok_path)
  cfg = load_config(sft_argv(d, "rows", f"tokenizer_path={tok_path}", *extra))
  slots = media_slots(DataConfig.from_config(cfg), tokenizer)
  return slots, sft.ChatToPairs(sft.ChatFormat.for_tokenizer(tok_path, str(d / "chat.jinja")),
                                tokenizer, 128, True, "truncate", Processor.for_tokenizer(tokenizer),
                                slots)


def test_rows_equal_the_processor_and_mask_the_assistant(setup):
  """The first conversation as a row: the ids are apply_chat_template's on the processor (the
  image's placeholder expanded to boi, 70-or-fewer soft tokens, eoi), the pixels its tensors, and
  only the assistant's tokens are in the loss."""
  d, _, data, oracle = setup
  record = json.loads(open(data, encoding="utf-8").readline())
  slots, to_pairs = _chat_to_pairs(setup)
  assert slots is not None and slots.specs()["pixel_values"][0] == (1, 280, 12)
  row = to_pairs((record, f"{data} line 1"))
  assert isinstance(row, dict), row.why
  messages = [{**m, "content": [{**p, "image": str(d / p["image"])} if p["type"] == "image"
                                else p for p in m["content"]]} if m["role"] == "user" else m
              for m in record["messages"]]
  want = oracle.apply_chat_template(messages, tokenize=True, return_dict=True,
                                    return_tensors="np", chat_template=GEMMA_TEMPLATE)
  ids = want["input_ids"][0]
  assert row["inputs"].tolist() == ids[:-1].tolist()
  assert row["targets"].tolist() == ids[1:].tolist()
  np.testing.assert_allclose(row["pixel_values"][0], want["pixel_values"][0], rtol=0, atol=1e-6)
  np.testing.assert_array_equal(row["image_position_ids"][0], want["image_position_ids"][0])
  assert not row["input_features_mask"].any()            # this conversation has no clip
  answer = [i for i, t in enumerate(row["targets"]) if row["loss_mask"][i]]
  assert answer and all(row["targets"][i] not in (IMAGE, BOI, EOI) for i in answer)
  assert sum(row["loss_mask"]) < len(row["loss_mask"]) / 4


# The two runs train the vision tower (freeze_vision_encoder=false) and keep the audio tower
# frozen (the default): one pair of programs shows both a trained tower (its backward pass, also
# sharded) and a frozen one. Freezing is one mechanism for every tower (Family.frozen's names →
# the step's gradient split and the optimizer's mask); which towers the keys name is
# tests/test_gemma4_vision.py's and tests/test_gemma4_mm_audio.py's `family.frozen` checks.
THAW = "freeze_vision_encoder=false"


@pytest.fixture(scope="module")
def one_device(setup):
  from MaxText.train.loop import run
  d = setup[0]
  code, trainer = run(sft_argv(d, "one", "per_device_batch_size=4", "ici_fsdp_parallelism=1",
                               THAW), devices=jax.devices()[:1])
  assert code == 0
  return trainer


def _flat(tree):
  from flax import traverse_util
  return {"/".join(map(str, k)): np.asarray(jax.device_get(v))
          for k, v in traverse_util.flatten_dict(tree).items()}


def test_eight_devices_equal_one_the_vision_tower_moves_and_the_audio_stays(setup, one_device):
  from MaxText.checkpoint.manager import load_params
  from MaxText.train.loop import run
  d = setup[0]
  code, eight = run(sft_argv(d, "eight", "per_device_batch_size=0.5", "ici_fsdp_parallelism=4",
                             "ici_tensor_parallelism=2", THAW))
  assert code == 0
  one_losses = [m["loss"] for m in read_metrics(os.path.join(d, "one"))]
  eight_losses = [m["loss"] for m in read_metrics(os.path.join(d, "eight"))]
  assert len(one_losses) == 3 and one_losses[-1] < one_losses[0]
  # fp32 sums in another order (sharded matmuls, the towers' reductions): 1e-5 relative
  np.testing.assert_allclose(eight_losses, one_losses, rtol=1e-5, atol=0)
  start = _flat(load_params(str(d / "ck")))
  a, b = _flat(one_device.final_state["params"]), _flat(eight.final_state["params"])
  moved = frozen = 0
  for k, v in start.items():
    assert np.abs(b[k] - a[k]).max() <= 1e-5 * max(np.abs(a[k]).max(), 1.0), k
    if k.split("/")[0] in ("audio", "embed_audio"):
      np.testing.assert_array_equal(a[k], v, err_msg=k)      # frozen: bit for bit
      np.testing.assert_array_equal(b[k], v, err_msg=k)
      frozen += 1
    else:
      moved += not np.array_equal(a[k], v)
  assert moved > 10 and frozen > 10
  # the trained vision tower moved (its encoder's layers, not only its embedder)
  key = next(k for k in start if k.startswith("vision/encoder/") and k.endswith("mlp/up/kernel"))
  assert not np.array_equal(a[key], start[key])


def _first_batch_trainer():
  from MaxText.train.loop import Trainer

  class FirstBatch(Trainer):
    """The trainer as `run` drives it (config, mesh, data iterator, its errors' exit codes), its
    training only the first batch's read: nothing compiled or loaded."""

    def _train(self, ckpts, data_iter, watch):
      del ckpts, watch
      next(data_iter)
      return 0
  return FirstBatch


def test_media_settings_refused(setup, capsys):
  from MaxText.train.loop import run
  d = setup[0]
  one = jax.devices()[:1]
  code, _ = run(sft_argv(d, "packed", "packing=true", "ici_fsdp_parallelism=1"), devices=one)
  assert code == 2 and "set packing=false" in capsys.readouterr().err
  # a conversation with media where the settings give it no slots: a bad record naming the keys
  # (the data pipeline's chat stage, where the trainer meets it; a bad record's way from there to
  # exit 3 naming its reason is the broken image's below — a run of its own would compile a
  # text-only step for nothing else)
  slots, to_pairs = _chat_to_pairs(setup, "max_num_images_per_example=0",
                                   "max_num_audio_per_example=0")
  record = json.loads(open(setup[2], encoding="utf-8").readline())
  bad = to_pairs((record, "chat.jsonl line 1"))
  assert slots is None and isinstance(bad, BadRecord), bad
  assert "max_num_images_per_example" in bad.why and bad.where == "chat.jsonl line 1"
  # an image that cannot be read: a bad record naming the file (exit 3 beyond max_bad_records),
  # met by the trainer's own data iterator at its first batch; the trainer up to that batch
  # (`_first_batch_trainer`: a full run compiles and loads first, then meets the same error there)
  broken = d / "broken.jsonl"
  broken.write_text(json.dumps({"messages": [
      {"role": "user", "content": [{"type": "image", "image": "missing.png"},
                                   {"type": "text", "text": "what is this"}]},
      {"role": "assistant", "content": "hello"}]}) + "\n")
  code, _ = run(sft_argv(d, "broken", f"dataset_path={broken}", "per_device_batch_size=4",
                         "ici_fsdp_parallelism=1", "max_bad_records=0"), devices=one,
                trainer_class=_first_batch_trainer())
  err = capsys.readouterr().err
  assert code == 3 and "missing.png" in err and "Traceback" not in err, err[-2000:]
