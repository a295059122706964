"""The Python API of decoding (compiled by MaxText/decoding/): load a model once, then generate from
prompts and score completions. No torch.

  from MaxText import inference
  model = inference.load(["load_parameters_path=runs/default/checkpoints"])   # from any directory
  [g] = model.generate(["def main("], max_new_tokens=32)        # g.text, g.output_ids, ...
  model.generate([[1, 5, 9]], temperature=0.8, top_p=0.9, seed=1)            # token ids
  model.generate([{"messages": [{"role": "user", "content": "Hi"}]}])        # chat template
  model.score([[1, 5, 9]], [[7, 8]])          # [array([log p(7 | 1 5 9), log p(8 | 1 5 9 7)])]

`load` takes what `python -m MaxText.decode` takes (a config file, then key=value; without one,
this repository's configs/base.yml), resolved as train.py resolves it (`resolve_config`: the
config file, then the model's architecture, then the command line): the parameters of
`load_parameters_path` (a run's checkpoints/, a step, a converter's output; its architecture comes
with it) or of `hf_path` (a Hugging Face folder converted in memory), the mesh and logical-axis
rules of training, and the decoding keys as `generate`'s defaults. A prompt is text (tokenized,
with the tokenizer's bos when `add_bos`; with `chat=true` a user message), token ids, or a dict
with "prompt", "prompt_ids" or chat "messages" (rendered with the tokenizer's own template,
MaxText/data/chat_template.py; with "messages" also "tools" and "chat_template_kwargs", as
transformers' `apply_chat_template(tools=, **kwargs)` takes them). A request that cannot run raises `InferenceError` (exit 2 in the
tools) naming the prompt, key or number.

Images and audio (a model whose family takes them, `Family.media`): `generate`, `score` and
`prepare` take `images=` / `audio=` (files, PIL images, uint8 arrays / WAV files, float
waveforms; per prompt, MaxText/data/multimodal/prompts.py says where they go), chat messages with
{"type": "image", "image": path} / {"type": "audio", "audio": path} parts, or the processor's own
tensors by transformers' names (`pixel_values=`, `image_position_ids=`, `input_features=`,
`input_features_mask=`, NumPy) with prompts that already hold the expanded placeholders. They are
prepared by the model folder's processor (MaxText/data/multimodal/processor.py), exactly as
transformers' does. An image or clip for a model without that tower, or more soft tokens than
the positions leave room for, is an InferenceError (exit 2); an unreadable file a MediaError
(exit 3).

  model.generate(["What is the highest bar?"], images=["chart.png"], chat=True)
  model.generate([{"messages": [{"role": "user", "content": [
      {"type": "audio", "audio": "clip.wav"}, {"type": "text", "text": "Transcribe."}]}]}])
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import numpy as np

from MaxText.checkpoint import tokenizer_files
from MaxText.checkpoint_conversion.to_maxtext import hf_params
from MaxText.config.load import BASE_YML, ConfigError, load_config, replace
from MaxText.config.schema import Config
from MaxText.data import chat_template
from MaxText.data.errors import DataError
from MaxText.data.multimodal import prompts as media_prompts
from MaxText.data.multimodal.processor import Batch, Processor
from MaxText.data.tokenizers import HFTokenizer, Tokenizer, make_tokenizer
from MaxText.decoding.engine import DecodeError, Engine
from MaxText.decoding.errors import InferenceError
from MaxText.decoding.sampling import Sampling
from MaxText.models.model_config import ModelConfig
from MaxText.models.registry import check_model, get_family, get_hf_map, make_model_def
from MaxText.resolve import hf_sharded, lora_base
from MaxText.resolve.architecture import adopt_architecture
from MaxText.resolve.config_checks import validate
from MaxText.resolve.tokenizer_setup import MissingTokenizer, choose_tokenizer
from MaxText.sharding.mesh import create_mesh
from MaxText.sharding.rules import parse_rules
from MaxText.backend.device_type import Device

Prompt = str | Sequence[int] | dict
TOWERS = {"image": "vision tower", "audio": "audio tower"}


@dataclass
class Generation:
  prompt_ids: list[int]
  output_ids: list[int]
  output_logprobs: list[float]     # of the chosen tokens, under the unmodified distribution
  finish_reason: str               # "eos" | "stop" | "length"
  text: str | None                 # the completion's text (None without a tokenizer)

  def as_json(self) -> dict:
    return {"prompt_ids": self.prompt_ids, "output_ids": self.output_ids,
            "output_logprobs": self.output_logprobs, "text": self.text,
            "finish_reason": self.finish_reason}


@dataclass
class Prepared:
  """A call's prompts as the model takes them: token ids (placeholders expanded), each prompt's
  image / audio tensors by transformers' names (None: a text call), `mm_token_type_ids` and each
  image's patch grid (rows, columns) per prompt."""
  ids: list[list[int]]
  media: list[dict[str, np.ndarray]] | None = None
  mm_token_type_ids: list[list[int]] | None = None
  image_grids: list[list[tuple[int, int]]] | None = None


def model_tokenizer(cfg: Config) -> tuple[Config, str]:
  """(`cfg` with the model's tokenizer keys resolved, a line saying which and why): training's
  choice (`resolve/tokenizer_setup.choose_tokenizer`: `tokenizer_path` when set, else the
  checkpoint's own tokenizer files, else its byte tokenizer), with a Hugging Face folder
  (`hf_path`) giving its own tokenizer files the same way. MissingTokenizer (a ConfigError) when
  the model's tokenizer is not at hand."""
  if cfg.hf_path and not cfg.tokenizer_path:
    folder = os.path.expanduser(cfg.hf_path)
    if not tokenizer_files.files_of(folder):
      raise MissingTokenizer(f"tokenizer_path: hf_path={cfg.hf_path} holds no tokenizer files; "
                             "set tokenizer_path")
    cfg = replace(cfg, tokenizer_path=folder)
  return choose_tokenizer(cfg)


def tokenizer_for(cfg: Config) -> tuple[Tokenizer | None, str]:
  """(the tokenizer of the model `cfg` decodes, or None, and where it comes from or why there is
  none): `model_tokenizer`'s choice."""
  try:
    cfg, line = model_tokenizer(cfg)
  except MissingTokenizer as e:
    return None, str(e)
  return make_tokenizer(cfg.tokenizer_type, cfg.tokenizer_path), line


class InferenceModel:
  """A model loaded for decoding: `generate` and `score` (see the module docstring)."""

  def __init__(self, cfg: Config, engine: Engine, params: Any, tokenizer: Tokenizer | None,
               tokenizer_source: str, eos_ids: Sequence[int] = ()):
    self.cfg, self.engine, self.params = cfg, engine, params
    self.tokenizer, self.tokenizer_source = tokenizer, tokenizer_source
    default_eos = [] if tokenizer is None or tokenizer.eos_id is None else [tokenizer.eos_id]
    self.eos_ids = list(cfg.eos_ids or eos_ids or default_eos)
    self._processor: Processor | None | bool = False     # False: not read yet

  # ---- prompts -----------------------------------------------------------------------------------
  def _need_tokenizer(self, what: str) -> Tokenizer:
    if self.tokenizer is None:
      raise InferenceError(f"{what} needs a tokenizer: {self.tokenizer_source}")
    return self.tokenizer

  def chat_text(self, messages: Sequence[dict], tools: Sequence[dict] | None = None,
                template_kwargs: dict | None = None) -> str:
    """`messages` rendered by the tokenizer's chat template (with the generation prompt), `tools`
    and `template_kwargs` as transformers' `apply_chat_template(tools=, **kwargs)` takes them."""
    tok = self._need_tokenizer("chat")
    if not isinstance(tok, HFTokenizer):
      raise InferenceError(f"chat=true needs a Hugging Face tokenizer with a chat template; the "
                           f"tokenizer is {tok!r}")
    if template_kwargs is not None and not isinstance(template_kwargs, dict):
      raise InferenceError(f"chat_template_kwargs must be an object, got {template_kwargs!r:.100}")
    folder = os.path.dirname(tok.path)
    processor = self.processor
    names = processor.tokens if processor is not None else {}
    try:
      return chat_template.render(chat_template.find_template(folder), messages,
                                  {**names, **chat_template.special_tokens(folder)}, tools=tools,
                                  template_kwargs=template_kwargs)
    except DataError as e:
      raise InferenceError(str(e)) from None

  def render_chat(self, messages: Sequence[dict], tools: Sequence[dict] | None = None,
                  template_kwargs: dict | None = None) -> list[int]:
    return self._need_tokenizer("chat").encode(self.chat_text(messages, tools, template_kwargs))

  @staticmethod
  def chat_options(prompt: dict) -> tuple[Any, Any]:
    """(tools, chat_template_kwargs) of a prompt object with "messages"."""
    return prompt.get("tools"), prompt.get("chat_template_kwargs")

  def encode(self, prompt: Prompt, chat: bool | None = None) -> list[int]:
    """The token ids of one prompt (module docstring)."""
    chat = self.cfg.chat if chat is None else chat
    if isinstance(prompt, dict):
      keys = [k for k in ("prompt", "prompt_ids", "messages") if k in prompt]
      if len(keys) != 1:
        raise InferenceError(f"a prompt object needs exactly one of prompt, prompt_ids, messages; "
                             f"got keys {sorted(prompt)}")
      if keys[0] == "messages":
        return self.render_chat(prompt["messages"], *self.chat_options(prompt))
      return self.encode(prompt[keys[0]], chat)
    if isinstance(prompt, str):
      if not prompt:
        return []
      if chat:
        return self.render_chat([{"role": "user", "content": prompt}])
      tok = self._need_tokenizer("a text prompt")
      ids = tok.encode(prompt)
      return [tok.bos_id, *ids] if self.cfg.add_bos and tok.bos_id is not None else ids
    if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt):
      raise InferenceError(f"prompt ids must be integers, got {list(prompt)[:8]!r}")
    return [int(t) for t in prompt]

  def text(self, ids: Sequence[int]) -> str | None:
    return None if self.tokenizer is None else self.tokenizer.decode(ids)

  def decoder(self) -> Callable[[Sequence[int]], str] | None:
    """The tokenizer's ids → text (`text` where a tokenizer is needed), None without one."""
    return None if self.tokenizer is None else self.tokenizer.decode

  # ---- images and audio ----------------------------------------------------------------------
  @property
  def processor(self) -> Processor | None:
    """The processor beside the model's tokenizer (processor_config.json), None without one."""
    if self._processor is False:
      try:
        self._processor = Processor.for_tokenizer(self.tokenizer)
      except DataError as e:
        raise InferenceError(str(e)) from None
    return self._processor if isinstance(self._processor, Processor) else None

  def _taking(self, modalities: set[str]) -> Processor:
    """The processor, after checking that the model and it take `modalities`."""
    takes = get_family(self.cfg.decoder_block).media(self.engine.mcfg)
    for m in sorted(modalities - set(takes)):
      raise InferenceError(f"{m} inputs given, but the model ({self.cfg.decoder_block}, "
                           f"{self.cfg.num_decoder_layers} layers) has no {TOWERS[m]}")
    processor = self.processor
    if processor is None:
      raise InferenceError(f"{' and '.join(sorted(modalities))} inputs need the model's processor "
                           f"(processor_config.json / preprocessor_config.json beside its "
                           f"tokenizer): {self.tokenizer_source}")
    for m in sorted(modalities):
      problem = processor.takes(m)
      if problem:
        raise InferenceError(f"{m} inputs: {problem}")
    return processor

  def _encode_with_media(self, prompt: Prompt, images: list, clips: list, chat: bool,
                         processor: Processor | None) -> tuple[list[int], list, list]:
    """(ids with one placeholder per image and clip, the images, the clips) of one prompt."""
    if isinstance(prompt, dict):
      keys = [k for k in ("prompt", "prompt_ids", "messages") if k in prompt]
      if len(keys) != 1:
        raise InferenceError(f"a prompt object needs exactly one of prompt, prompt_ids, messages; "
                             f"got keys {sorted(prompt)}")
      try:
        images = [*media_prompts.per_prompt(prompt.get("images"), 1, "images")[0], *images]
        clips = [*media_prompts.per_prompt(prompt.get("audio"), 1, "audio")[0], *clips]
        if keys[0] == "messages":
          messages, images, clips = media_prompts.fill_messages(prompt["messages"], images, clips)
          return self.render_chat(messages, *self.chat_options(prompt)), images, clips
      except DataError as e:
        raise InferenceError(str(e)) from None
      prompt = prompt[keys[0]]
    if isinstance(prompt, str) and chat and prompt:
      return self.render_chat(media_prompts.user_message(prompt, images, clips)), images, clips
    ids = self.encode(prompt, chat)
    if processor is None or not (images or clips):
      return ids, images, clips
    tok = self.tokenizer
    return media_prompts.with_placeholders(
        ids, len(images), len(clips), processor.ids.get("image_token"),
        processor.ids.get("audio_token"), tok.bos_id if tok is not None else None), images, clips

  def prepare(self, prompts: Sequence[Prompt], *, images: Any = None, audio: Any = None,
              chat: bool | None = None, **tensors: np.ndarray) -> Prepared:
    """A call's prompts as the model takes them (module docstring): their ids, and with images or
    audio their tensors (`Prepared`). Every tensor transformers' processor returns is taken:
    `input_ids`, `attention_mask` and `mm_token_type_ids` are checked against the prompts
    (InferenceError naming the one that differs). InferenceError (exit 2) for a request that
    cannot run, MediaError (exit 3) for an unreadable image or clip."""
    given = {n: tensors.pop(n) for n in media_prompts.PROMPT_TENSORS if n in tensors}
    prepared = self._prepare(prompts, images, audio, chat, tensors)
    if given:   # the processor's own view of the prompts: checked against ours
      try:
        media_prompts.check_prompt_tensors(given, prepared.ids, prepared.mm_token_type_ids)
      except DataError as e:
        raise InferenceError(str(e)) from None
    return prepared

  def _prepare(self, prompts, images, audio, chat, tensors) -> Prepared:
    chat = self.cfg.chat if chat is None else chat
    known = [*(n for ns in media_prompts.TENSOR_NAMES.values() for n in ns),
             *media_prompts.PROMPT_TENSORS]
    unknown = sorted(set(tensors) - set(known))
    if unknown:
      raise InferenceError(f"unknown keyword arguments {unknown}; the processor's tensors are "
                           f"{known}")
    try:
      per_images = media_prompts.per_prompt(images, len(prompts), "images")
      per_clips = media_prompts.per_prompt(audio, len(prompts), "audio")
    except DataError as e:
      raise InferenceError(str(e)) from None
    if tensors and (images is not None or audio is not None):
      raise InferenceError("give images / audio or the processor's tensors, not both")
    if tensors:
      return self._prepare_tensors([self.encode(p, chat) for p in prompts], tensors)
    wants = {m for m, per in (("image", per_images), ("audio", per_clips)) if any(per)}
    wants |= {m for p in prompts if isinstance(p, dict) for m, k in (("image", "images"),
                                                                      ("audio", "audio")) if p.get(k)}
    for p in prompts:
      if isinstance(p, dict) and "messages" in p:
        found_images, found_clips = media_prompts.media_of_messages(p["messages"])
        wants |= {"image"} if found_images else set()
        wants |= {"audio"} if found_clips else set()
    processor = self._taking(wants) if wants else None
    rows = [self._encode_with_media(p, im, cl, chat, processor)
            for p, im, cl in zip(prompts, per_images, per_clips)]
    if processor is None:
      return Prepared([r[0] for r in rows])
    try:
      batch = processor.prepare([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])
    except DataError as e:
      raise InferenceError(str(e)) from None
    return self._prepared(batch)

  @staticmethod
  def _prepared(batch: Batch) -> Prepared:
    n = len(batch.input_ids)
    grids = [[g for g, r in zip(batch.image_grids, batch.image_rows) if r == i] for i in range(n)]
    return Prepared(batch.input_ids, [batch.tensors(i) for i in range(n)],
                    batch.mm_token_type_ids, grids)

  def _prepare_tensors(self, ids: list[list[int]], tensors: dict[str, np.ndarray]) -> Prepared:
    """Prompts already expanded, with the processor's tensors as they are."""
    given = {m for m, names in media_prompts.TENSOR_NAMES.items() if set(names) & set(tensors)}
    processor = self._taking(given)
    per_image, per_clip = processor.soft_tokens_of(tensors)
    try:
      media = media_prompts.split_tensors(
          tensors, ids, {"image": per_image, "audio": per_clip},
          {"image": processor.ids.get("image_token"), "audio": processor.ids.get("audio_token")})
    except DataError as e:
      raise InferenceError(str(e)) from None
    grids = [[processor.grid_of(p) for p in m.get("image_position_ids", [])] for m in media]
    return Prepared(ids, media, [processor.token_types(r) for r in ids], grids)

  def check_room(self, prepared: Prepared, new_tokens: int, limit: int, limit_name: str) -> None:
    """InferenceError (exit 2) with the counts when a prompt's soft tokens leave no room within
    `limit` positions for it and `new_tokens` more."""
    if prepared.media is None:
      return
    for i, ids in enumerate(prepared.ids):
      types = prepared.mm_token_type_ids[i] if prepared.mm_token_type_ids else []
      image, audio = types.count(1), types.count(3)
      if limit and len(ids) + new_tokens > limit:
        n_img = len(prepared.media[i].get("pixel_values", []))
        n_aud = len(prepared.media[i].get("input_features", []))
        raise InferenceError(
            f"prompt {i}: {len(ids) - image - audio} text tokens + {image} image soft tokens "
            f"({n_img} image(s)) + {audio} audio soft tokens ({n_aud} clip(s)) = {len(ids)} "
            f"positions" + (f" + max_new_tokens={new_tokens}" if new_tokens else "")
            + f" overflow {limit_name} ({limit}); give fewer or smaller images / shorter clips, "
            f"or raise {limit_name}")

  # ---- requests ----------------------------------------------------------------------------------
  def generate(self, prompts: Sequence[Prompt], *, max_new_tokens: int | None = None,
               temperature: float | None = None, top_k: int | None = None,
               top_p: float | None = None, min_p: float | None = None, seed: int | None = None,
               stop: Sequence[str] | None = None, eos_ids: Sequence[int] | None = None,
               chat: bool | None = None, images: Any = None, audio: Any = None,
               **tensors: np.ndarray) -> list[Generation]:
    """Completions of `prompts`, in order; unset arguments take the config's keys. `images`,
    `audio` and the processor's tensors: module docstring."""
    cfg = self.cfg
    pick = lambda v, key: getattr(cfg, key) if v is None else v
    sampling = Sampling(pick(temperature, "temperature"), pick(top_k, "top_k"),
                        pick(top_p, "top_p"), pick(min_p, "min_p"), pick(seed, "seed"))
    stop = list(pick(stop, "stop"))
    prepared = self.prepare(prompts, images=images, audio=audio, chat=chat, **tensors)
    ids = prepared.ids
    for i, encoded in enumerate(ids):
      if not encoded:
        raise InferenceError(f"prompt {i} is empty")
    new_tokens = pick(max_new_tokens, "max_new_tokens")
    limit, name = ((cfg.max_cache_length, "max_cache_length") if cfg.max_cache_length else
                   (self.engine.mcfg.max_position_embeddings, "the model's max_position_embeddings"))
    self.check_room(prepared, new_tokens, limit, name)
    if stop:
      self._need_tokenizer("stop strings")
    try:
      done = self.engine.generate(self.params, ids, max_new_tokens=new_tokens,
                                  sampling=sampling, eos_ids=list(pick(eos_ids, "eos_ids") or
                                                                  self.eos_ids),
                                  stop=stop, detokenize=self.decoder(), media=prepared.media)
    except DecodeError as e:
      raise InferenceError(str(e)) from None
    return [Generation(c.prompt_ids, c.output_ids, c.output_logprobs, c.finish_reason,
                       self.text(c.output_ids)) for c in done]

  def score(self, prompt_ids: Sequence[Sequence[int]],
            completion_ids: Sequence[Sequence[int]],
            media: Sequence[dict[str, np.ndarray]] | None = None) -> list[np.ndarray]:
    """log p(completion token | prompt, the completion before it), per completion (batched and
    sharded like decoding); `media`: each prompt's tensors (`prepare(...).media`), the prompts
    their expanded ids."""
    try:
      return self.engine.score(self.params, prompt_ids, completion_ids, media=media)
    except DecodeError as e:
      raise InferenceError(str(e)) from None


class ShardedHF:
  """A Hugging Face folder not read yet: `place` reads each process's slices of every parameter
  straight onto the mesh (resolve/hf_sharded.py)."""

  def __init__(self, folder: str, hf_model_type: str):
    self.folder, self.hf_model_type = folder, hf_model_type

  def place(self, mcfg: ModelConfig, abstract: Any) -> Any:
    params, stats = hf_sharded.load_sharded(self.folder, get_hf_map(self.hf_model_type), mcfg,
                                            abstract)
    print(f"[process {jax.process_index()}/{jax.process_count()}] read {stats.bytes} bytes of "
          f"{self.folder} in {stats.reads} ranged reads", flush=True)
    return params


def place_hf(hf_params: Any, mcfg: ModelConfig, model_def: Any, shardings: Any) -> Any:
  """`load_config_for_decoding`'s parameters on the mesh: host arrays put there, a ShardedHF
  read there."""
  if isinstance(hf_params, ShardedHF):
    return hf_params.place(mcfg, jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        model_def.abstract_params, shardings))
  return jax.device_put(hf_params, shardings)


def sharded_hf_config(folder: str, overrides: list[str]) -> tuple[Config, ShardedHF] | None:
  """(the config of the folder on configs/base.yml with `overrides`, the folder to read): the
  resolution of `resolve_config` without a config file (the workers and benchmarks that read a
  folder alone); None when the folder's family reads whole tensors."""
  cfg = resolve_config([BASE_YML, f"hf_path={folder}", *overrides])
  if not hf_sharded.reads_sharded(get_hf_map(cfg.hf_model_type)):
    return None
  return cfg, sharded_hf(cfg)


def sharded_hf(cfg: Config) -> ShardedHF:
  """The folder at `cfg.hf_path` (the config resolved) to read onto the mesh, its tensors checked
  against the model first (HFFolderError naming a missing or misshapen one: exit 4)."""
  st = hf_sharded.SafetensorsFolder(cfg.hf_path)
  mcfg = ModelConfig.from_config(cfg)
  hf_sharded.check_folder(st, hf_sharded.folder_map(get_hf_map(cfg.hf_model_type), st.tensors,
                                                    mcfg),
                          mcfg, hf_sharded.flatten(make_model_def(mcfg).abstract_params))
  return ShardedHF(cfg.hf_path, cfg.hf_model_type)


def resolve_config(argv: Sequence[str]) -> Config:
  """The config a tool runs, resolved as train.py's (MaxText/resolve/architecture.py): the user's
  config file `argv[0]`, then the architecture of `hf_path` (config.json) or of
  `load_parameters_path` (the checkpoint's config), then the command line. Reads no parameter.
  With hf_path the tokenizer type is the folder's files' unless the user chose one; the model
  is checked against the family (`check_model`). ConfigError (exit 2) naming the key or path."""
  cfg = load_config(argv)
  if not cfg.hf_path:
    return adopt_architecture(cfg, argv, training=False)
  try:
    resolved = adopt_architecture(cfg, argv, training=False)
  except ConfigError:
    raise
  except (FileNotFoundError, KeyError, ValueError) as e:   # ValueError: a bad folder
    raise ConfigError(f"hf_path={cfg.hf_path}: {e}") from None
  if cfg.tokenizer_type == "auto" and not cfg.tokenizer_path:
    # the vocabulary is a real tokenizer's: the folder's files say which
    tokenizer = tokenizer_files.files_of(resolved.hf_path)
    resolved = replace(resolved, tokenizer_type="huggingface" if "tokenizer.json" in tokenizer
                       or not tokenizer else "sentencepiece")
  for key, problem in check_model(ModelConfig.from_config(resolved), resolved.hf_model_type):
    raise ConfigError(f"{key}: {problem}")
  return resolved


def load_config_for_decoding(argv: Sequence[str]) -> tuple[Config, Any]:
  """The config (`resolve_config`) and, for hf_path, its parameters: a ShardedHF (read onto the
  mesh by `place_hf`) or, for a family whose map reads whole tensors, the converted host
  parameters."""
  cfg = resolve_config(argv)
  if not cfg.hf_path:
    return cfg, None
  try:
    if hf_sharded.reads_sharded(get_hf_map(cfg.hf_model_type)):
      return cfg, sharded_hf(cfg)
    return cfg, hf_params(cfg.hf_path, cfg)
  except (FileNotFoundError, KeyError, ValueError) as e:   # ValueError: a bad folder
    raise ConfigError(f"hf_path={cfg.hf_path}: {e}") from None


def _generation_config_eos(hf_path: str) -> list[int]:
  """The eos ids of a Hugging Face folder's generation_config.json (what transformers stops at)."""
  path = os.path.join(os.path.expanduser(hf_path), "generation_config.json")
  if not os.path.isfile(path):
    return []
  with open(path, encoding="utf-8") as f:
    eos = json.load(f).get("eos_token_id")
  return [eos] if isinstance(eos, int) else [int(e) for e in eos or []]


def load(argv: Sequence[str] | Config, devices: Sequence[Device] | None = None,
         params: Any = None, per_layer: bool = False) -> InferenceModel:
  """A model ready to decode. `argv`: [base.yml, key=value, ...], or only the key=value items
  (then this repository's configs/base.yml, found from the package, so it works from any
  directory); or a Config (then `params`, host or device arrays, may replace loading).
  `per_layer` (the decoding tools pass it): with `decode_unroll_layers` the parameters are
  restacked per layer once loaded (MaxText/decoding/layout.py), for decoding only (the model's
  own layout is what training, inspection and checkpoints read).
  ConfigError / DataError / InferenceError: exit 2; CheckpointError: exit 4."""
  hf_params = None
  owned = params is None
  if isinstance(argv, Config):
    cfg = argv
  else:
    argv = list(argv)
    if not argv or "=" in argv[0]:
      argv = [BASE_YML, *argv]
    cfg, hf_params = load_config_for_decoding(argv)
  devices = list(jax.devices() if devices is None else devices)
  # the mesh, rules and model checks of training; decoding has no training rows to check
  validate(replace(cfg, max_target_length=min(cfg.max_target_length, cfg.max_position_embeddings)),
           devices)
  mcfg = ModelConfig.from_config(cfg)
  try:
    engine = Engine(mcfg, create_mesh(cfg, devices),
                    parse_rules(cfg.logical_axis_rules, cfg.mesh_axes), cache_dtype=cfg.cache_dtype,
                    batch_size=cfg.decode_batch_size, max_cache_length=cfg.max_cache_length,
                    speculative_tokens=cfg.speculative_tokens,
                    unroll_layers=cfg.decode_unroll_layers)
  except ValueError as e:
    raise InferenceError(str(e)) from None
  tokenizer, source = tokenizer_for(cfg)
  if tokenizer is not None and tokenizer.vocab_size > cfg.vocab_size:
    raise InferenceError(f"the tokenizer ({source}) has {tokenizer.vocab_size} ids but the model's "
                         f"vocab_size is {cfg.vocab_size}")
  if params is None and hf_params is not None:
    params = place_hf(hf_params, mcfg, engine.model_def, engine.param_shardings)
  elif params is None:
    if not cfg.load_parameters_path:
      raise ConfigError("decoding needs parameters: set load_parameters_path or hf_path")
    abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            engine.model_def.abstract_params, engine.param_shardings)
    # read as saved, then cast to weight_dtype (e.g. a float32 training checkpoint in bfloat16)
    params = lora_base.load_cast(cfg.load_parameters_path, mcfg, abstract,
                                 verify=cfg.checkpoint_verify)
  else:
    params = engine.place(params)
  if per_layer and cfg.decode_unroll_layers:   # the scanned arrays deleted as they are cut,
    params = engine.per_layer(params, consume=owned)   # unless they are the caller's
  eos = _generation_config_eos(cfg.hf_path) if cfg.hf_path else []
  return InferenceModel(cfg, engine, params, tokenizer, source, eos)
