"""A short sample from the model during training: after the last step (`sample_at_end`) and every
`sample_period` steps, so a newcomer sees the text improve. The prompt is `prompt` (or
`prompt_ids`); with neither, the first `sample_prompt_tokens` tokens of a held-out document (the
evaluation data: `eval_dataset_path` or the `eval_split_fraction` share), else of the first
training document (synthetic data: the tokenizer's bos alone). Chat data (`sft=true`): the first
held-out (else training) conversation up to its last assistant message, rendered by the chat
template with the generation prompt, so the model answers as it was trained to. It is continued for
`max_new_tokens` with `sample_temperature` and `sample_top_k` (and `top_p`, `min_p`, `seed`,
`stop`, `eos_ids`), by the decoding engine (MaxText/decoding/) on the training mesh, with the
parameters as they are sharded for training. Greedy decoding (`sample_temperature=0`) of a small
byte-level model soon repeats one token (after 300 steps of the README run, `"` 64 times: the
likeliest byte after `""` is `"`), which is why the default samples. Control characters of the
text are printed escaped (`\x00`, `data/printable.py`), so the log stays text for grep."""
from __future__ import annotations

from typing import Any

from jax.sharding import Mesh

from MaxText.config.schema import Config
from MaxText.data import sft, sources
from MaxText.data.bad_records import BadRecord
from MaxText.data.config import DataConfig
from MaxText.data.errors import DataError
from MaxText.data.eval_data import eval_problems, eval_source
from MaxText.data.printable import printable
from MaxText.data.tokenizers import Tokenizer
from MaxText.decoding.engine import Completion, DecodeError, Engine
from MaxText.decoding.sampling import Sampling
from MaxText.models.model_config import ModelConfig
from MaxText.sharding.rules import Rules


def sample_prompt(cfg: Config, tokenizer: Tokenizer) -> tuple[list[int] | None, str]:
  """(the sample's prompt ids — None: there is nothing to start from —, where it came from)."""
  if cfg.prompt_ids:
    return list(cfg.prompt_ids), "prompt_ids"
  bos = [tokenizer.bos_id] if cfg.add_bos and tokenizer.bos_id is not None else []
  if cfg.prompt:
    return bos + tokenizer.encode(cfg.prompt), "prompt"
  if cfg.sft:   # the chat template writes the special tokens
    messages, where = first_conversation(cfg)
    fmt = sft.ChatFormat.for_tokenizer(cfg.tokenizer_path, cfg.chat_template_path)
    return tokenizer.encode(fmt.render(messages, add_generation_prompt=True)), \
        f"{where} up to its last assistant message, by the chat template"
  text, where = first_document(cfg)
  if text is None:
    return bos or None, "the tokenizer's bos"
  return bos + tokenizer.encode(text)[:cfg.sample_prompt_tokens], \
      f"the first {cfg.sample_prompt_tokens} tokens of {where}"


def _sample_source(cfg: Config) -> tuple[DataConfig, str, str]:
  """(the data config the sample's document is read with, its split, what the document is)."""
  dcfg = DataConfig.from_config(cfg)
  if not eval_problems(dcfg, cfg.eval_dataset_path):
    dcfg, split = eval_source(dcfg, cfg.eval_dataset_path)
    return dcfg, split, "a held-out document"
  return dcfg, "train" if dcfg.eval_split_fraction > 0 else "all", "the first training document"


def first_conversation(cfg: Config) -> tuple[list[dict], str]:
  """(the messages before the last assistant message of the first readable chat record — held
  out, else of training —, what it is). DataError: no record is a conversation."""
  dcfg, split, where = _sample_source(cfg)
  records = sft.record_dataset(dcfg.dataset_path, dcfg.dataset_format,
                               eval_split_fraction=dcfg.eval_split_fraction, split=split)
  problem = "it holds no records"
  for index in range(len(records)):
    doc = records[index]
    assert doc is not None, "a source MapDataset (no filter) holds every record"
    if isinstance(doc, BadRecord):
      problem = doc.why
      continue
    try:
      messages = sft.messages_of(doc[0])
    except DataError as e:
      problem = str(e)
      continue
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return messages[:last], where.replace("document", f"conversation ({doc[1]})")
  raise DataError(f"no chat record of {dcfg.dataset_path} to take a sample's prompt from "
                  f"({problem})")


def first_document(cfg: Config) -> tuple[str | None, str]:
  """(the first held-out document, else the first training one — None for synthetic data —, what
  it is)."""
  if cfg.dataset_type == "synthetic" and eval_problems(DataConfig.from_config(cfg),
                                                       cfg.eval_dataset_path):
    return None, ""
  dcfg, split, where = _sample_source(cfg)
  docs = sources.document_dataset(dcfg.dataset_type, dcfg.dataset_path, dcfg.dataset_format,
                                  dcfg.dataset_text_field,
                                  eval_split_fraction=dcfg.eval_split_fraction, split=split)
  return docs[0], where


class Sampler:
  """Prints samples of a training run (the engine is built at the first one)."""

  def __init__(self, cfg: Config, mcfg: ModelConfig, mesh: Mesh, rules: Rules,
               tokenizer: Tokenizer):
    self.cfg, self.mcfg, self.mesh, self.rules, self.tokenizer = cfg, mcfg, mesh, rules, tokenizer
    self.engine: Engine | None = None

  def due(self, step: int, last: bool) -> bool:
    cfg = self.cfg
    return (last and cfg.sample_at_end) or bool(cfg.sample_period and step % cfg.sample_period == 0)

  def sampling(self) -> Sampling:
    cfg = self.cfg
    return Sampling(cfg.sample_temperature, cfg.sample_top_k, cfg.top_p, cfg.min_p, cfg.seed)

  def generate(self, params: Any) -> tuple[list[int] | None, str, Completion | None]:
    """(the prompt, where it came from, its continuation by the model with `params`); None for
    the prompt when there is nothing to start from. DecodeError: it cannot be decoded."""
    cfg = self.cfg
    prompt, where = sample_prompt(cfg, self.tokenizer)
    if prompt is None:
      return None, where, None
    if self.engine is None:
      self.engine = Engine(self.mcfg, self.mesh, self.rules, cache_dtype=cfg.cache_dtype,
                           batch_size=1)
    eos = cfg.eos_ids or ([self.tokenizer.eos_id] if self.tokenizer.eos_id is not None else [])
    [done] = self.engine.generate(params, [prompt], max_new_tokens=cfg.max_new_tokens,
                                  sampling=self.sampling(), eos_ids=eos, stop=cfg.stop,
                                  detokenize=self.tokenizer.decode)
    return prompt, where, done

  def text(self, step: int, params: Any) -> str:
    """The lines to print: a header, the prompt and its continuation (or why there is none)."""
    if self.tokenizer is None:
      return (f"sample after step {step}: none (the run has no tokenizer: the model's tokenizer "
              "files are not at hand and dataset_type=synthetic needs none)")
    try:
      prompt, where, done = self.generate(params)
    except DecodeError as e:
      return f"sample after step {step}: none ({e})"
    if prompt is None or done is None:   # (done is None exactly when the prompt is)
      return f"sample after step {step}: none (no prompt, and the tokenizer has no bos)"
    sampling = self.sampling()
    how = "greedy" if sampling.temperature == 0 else (
        f"temperature {sampling.temperature}"
        + (f", top-k {sampling.top_k}" if sampling.top_k else "") + f", seed {sampling.seed}")
    block = lambda text: "\n".join("  | " + line for line in printable(text).split("\n"))
    return (f"sample after step {step} ({how}, {len(done.output_ids)} tokens, "
            f"{done.finish_reason}):\n  prompt ({where}):\n{block(self.tokenizer.decode(prompt))}"
            f"\n  continued by the model:\n{block(self.tokenizer.decode(done.output_ids))}")
