"""A tiny random-init multimodal Gemma 4 (text + vision + audio) built locally for
end_to_end/gemma4_multimodal.sh, and its checks against transformers.

  python -m end_to_end.tiny_multimodal build DIR     the model folder DIR/hf (weights, config,
                                                     tokenizer with the placeholder tokens, a
                                                     Gemma-style chat template, the processor's
                                                     files), an image, a WAV clip and chat records
                                                     with image parts (DIR/chat.jsonl)
  python -m end_to_end.tiny_multimodal logits DIR    our logits on a prompt with the image and the
                                                     clip (MaxText.inspect on DIR/ckpt) against
                                                     transformers' on its own processor's tensors

The model is configs/models/gemma4-mm-tiny.yml with a 2-layer audio conformer; norm weights are
perturbed so that a forgotten scale shows.
"""
from __future__ import annotations

import json
import os
import sys
import wave

import numpy as np

AUDIO = ["audio_hidden_size=32", "audio_num_layers=2", "audio_num_heads=4",
         "audio_subsampling_channels=[128,4]", "audio_output_dim=48"]
TOKENS = {"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
          "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>"}
# ids as configs/models/gemma4-mm-tiny.yml places them
SPECIAL_IDS = {376: "<|audio>", 377: "<audio|>", 378: "<|image>", 379: "<image|>",
               380: "<|image|>", 381: "<|video|>", 382: "<|audio|>"}
WORDS = ["<pad>", "<eos>", "<bos>", "[UNK]", "<start_of_turn>", "<end_of_turn>", "user", "model",
         "what", "is", "this", "hello", "say", "and", "a", "picture", "sound"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|image|>{% elif p['type'] == 'audio' %}<|audio|>"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %} {% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
IMAGE = dict(patch_size=2, max_soft_tokens=70, pooling_kernel_size=2)
FEATURES = dict(feature_size=128)


def our_config():
  from MaxText.config.load import load_config
  return load_config(["configs/base.yml", "model_name=gemma4-mm-tiny", *AUDIO])


def build(out: str) -> None:
  import PIL.Image
  import torch
  import transformers
  from tokenizers import Tokenizer, models, pre_tokenizers, processors
  from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
  from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

  from MaxText.models.gemma4 import gemma4_hf_map
  hf = gemma4_hf_map.config_to_hf(our_config())
  torch.manual_seed(0)
  model = transformers.Gemma4ForConditionalGeneration(transformers.Gemma4Config(**hf))
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.add_(0.1 * torch.randn_like(p))
  folder = os.path.join(out, "hf")
  model.save_pretrained(folder)
  vocab = hf["text_config"]["vocab_size"]
  words = [SPECIAL_IDS.get(i) or (WORDS[i] if i < len(WORDS) else f"w{i}") for i in range(vocab)]
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
  plain = lambda d: json.loads(json.dumps(d, default=lambda o: np.asarray(o).tolist()))
  with open(os.path.join(folder, "processor_config.json"), "w", encoding="utf-8") as f:
    json.dump({"processor_class": "Gemma4Processor", "image_seq_length": 70,
               "audio_seq_length": 750,
               "image_processor": plain(Gemma4ImageProcessorPil(**IMAGE).to_dict()),
               "feature_extractor": plain(Gemma4AudioFeatureExtractor(**FEATURES).to_dict())}, f)
  rng = np.random.default_rng(0)
  for i, (h, w) in enumerate([(24, 40), (36, 20), (30, 30), (16, 44)]):
    PIL.Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(
        os.path.join(out, f"img{i}.png"))
  with wave.open(os.path.join(out, "clip.wav"), "wb") as wav:
    wav.setnchannels(1)
    wav.setsampwidth(2)
    wav.setframerate(16000)
    wav.writeframes((rng.standard_normal(9000) * 3000).astype("<i2").tobytes())
  answers = ["a picture", "hello", "say hello", "this is a picture"]
  with open(os.path.join(out, "chat.jsonl"), "w", encoding="utf-8") as f:
    for i in range(8):
      content = [{"type": "image", "image": f"img{i % 4}.png"},
                 {"type": "text", "text": "what is this"}]
      f.write(json.dumps({"messages": [{"role": "user", "content": content},
                                       {"role": "assistant", "content": answers[i % 4]}]}) + "\n")
  print(f"built {folder}: Gemma4ForConditionalGeneration with vision and audio towers")


def logits(out: str) -> None:
  import PIL.Image
  import torch
  import transformers
  from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
  from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

  from MaxText import inspect as mi
  from MaxText.data.multimodal.audio import read_wav
  image, clip = os.path.join(out, "img0.png"), os.path.join(out, "clip.wav")
  m = mi.load(load_parameters_path=os.path.join(out, "ckpt"), overrides=["dtype=float32"])
  t = m.forward("what is <|image|> and <|audio|> this", capture={"logits"}, images=[image],
                audio=[clip])
  ids = np.asarray(t.tokens)
  pix = Gemma4ImageProcessorPil(**IMAGE)(images=[np.asarray(PIL.Image.open(image).convert("RGB"))],
                                         return_tensors="np")
  feats = Gemma4AudioFeatureExtractor(**FEATURES)([read_wav(clip, 16000)], return_tensors="np")
  model = transformers.Gemma4ForConditionalGeneration.from_pretrained(
      os.path.join(out, "hf"), attn_implementation="eager").float().eval()
  types = (ids == 380) * 1 + (ids == 382) * 3
  with torch.no_grad():
    want = model(input_ids=torch.tensor(ids[None].astype(np.int64)),
                 pixel_values=torch.tensor(pix["pixel_values"]),
                 image_position_ids=torch.tensor(pix["image_position_ids"].astype(np.int64)),
                 input_features=torch.tensor(feats["input_features"]),
                 input_features_mask=torch.tensor(feats["input_features_mask"]),
                 mm_token_type_ids=torch.tensor(types[None].astype(np.int64))).logits[0].numpy()
  got = np.asarray(t.logits)
  err = float(np.abs(got - want).max() / np.abs(want).max())
  print(f"logits with an image ({int((ids == 380).sum())} soft tokens) and a clip "
        f"({int((ids == 382).sum())} soft tokens): max |ours - transformers| / max |logit| = "
        f"{err:.1e}")
  if err > 1e-4:
    sys.exit("logits differ from transformers' by more than 1e-4 of their largest magnitude")


if __name__ == "__main__":
  {"build": build, "logits": logits}[sys.argv[1]](sys.argv[2])
