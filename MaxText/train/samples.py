"""A short sample from the model during training: after the last step (`sample_at_end`) and every
`sample_period` steps, so a newcomer sees the text improve. The prompt is `prompt` (or
`prompt_ids`; with neither, the tokenizer's bos alone: a document from its start), continued for
`max_new_tokens` with the decoding keys (`temperature`, 0 = greedy, `top_k`, `top_p`, `min_p`,
`seed`, `stop`, `eos_ids`), by the decoding engine (MaxText/decoding/) on the training mesh, with
the parameters as they are sharded for training."""
from __future__ import annotations

from typing import Any

from jax.sharding import Mesh

from MaxText.config.schema import Config
from MaxText.data.tokenizers import Tokenizer
from MaxText.decoding.engine import DecodeError, Engine
from MaxText.decoding.sampling import Sampling
from MaxText.models.model_config import ModelConfig
from MaxText.sharding.rules import Rules


def sample_prompt(cfg: Config, tokenizer: Tokenizer) -> list[int] | None:
  """The sample's prompt ids (None: there is nothing to start from)."""
  if cfg.prompt_ids:
    return list(cfg.prompt_ids)
  bos = [tokenizer.bos_id] if cfg.add_bos and tokenizer.bos_id is not None else []
  ids = bos + tokenizer.encode(cfg.prompt) if cfg.prompt else bos
  return ids or None


class Sampler:
  """Prints samples of a training run (the engine is built at the first one)."""

  def __init__(self, cfg: Config, mcfg: ModelConfig, mesh: Mesh, rules: Rules,
               tokenizer: Tokenizer):
    self.cfg, self.mcfg, self.mesh, self.rules, self.tokenizer = cfg, mcfg, mesh, rules, tokenizer
    self.engine: Engine | None = None

  def due(self, step: int, last: bool) -> bool:
    cfg = self.cfg
    return (last and cfg.sample_at_end) or bool(cfg.sample_period and step % cfg.sample_period == 0)

  def text(self, step: int, params: Any) -> str:
    """The lines to print: a header and the prompt + completion (or why there is none)."""
    cfg = self.cfg
    prompt = sample_prompt(cfg, self.tokenizer)
    if prompt is None:
      return f"sample after step {step}: none (no prompt, and the tokenizer has no bos)"
    if self.engine is None:
      self.engine = Engine(self.mcfg, self.mesh, self.rules, cache_dtype=cfg.cache_dtype,
                           batch_size=1)
    sampling = Sampling(cfg.temperature, cfg.top_k, cfg.top_p, cfg.min_p, cfg.seed)
    eos = cfg.eos_ids or ([self.tokenizer.eos_id] if self.tokenizer.eos_id is not None else [])
    try:
      [done] = self.engine.generate(params, [prompt], max_new_tokens=cfg.max_new_tokens,
                                    sampling=sampling, eos_ids=eos, stop=cfg.stop,
                                    detokenize=self.tokenizer.decode)
    except DecodeError as e:
      return f"sample after step {step}: none ({e})"
    how = "greedy" if sampling.temperature == 0 else f"temperature {sampling.temperature}"
    body = self.tokenizer.decode(prompt) + self.tokenizer.decode(done.output_ids)
    return (f"sample after step {step} ({how}, {len(done.output_ids)} tokens, "
            f"{done.finish_reason}):\n" + "\n".join("  | " + line for line in body.split("\n")))
