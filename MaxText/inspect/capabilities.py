"""What an inspection model can do, declared before anything compiles: an evaluation tool asks
`m.capabilities` (or `capabilities_of(cfg)` before loading any weights) and negotiates from it.

Each field is computed from the model's family (decoding, the towers it has), the checkpoint
(its tokenizer and processor files) and the attention setting the forward runs with (only the
dot-product op materialises attention probabilities: "reference", the default, picks it whatever
trained the model; "model" keeps the configured op, so `attentions` and the attention sites are
refused — `check_capture` — before any program is built).

The model's modules (jax) are imported by the functions that use them: the package imports this
module first, and `python -m MaxText.inspect --help` then answers without jax.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
  from MaxText.models.model_config import ModelConfig

ATTENTION_SETTINGS = ("reference", "model")
REFERENCE_OP = "dot_product"


@dataclass(frozen=True)
class Capabilities:
  generate: bool          # the engine decodes this family (it declares a decoding cache)
  logprobs: bool          # teacher-forced scoring (the same `extend` as decoding)
  hidden_states: bool
  logits: bool
  attentions: bool        # attention probabilities and scores (the dot-product op only)
  gradients: bool         # `grad` with respect to a site
  interventions: bool     # `intervene` / `forward(interventions=...)`
  chat: bool              # a Hugging Face tokenizer (chat templates) is at hand
  images: bool            # the family has a vision tower and the checkpoint a processor for it
  audio: bool             # likewise an audio tower
  lora: bool              # `lora_finetune` (adapters on the projections; needs float weights)
  attention_op: str       # the op the inspected forward runs

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)

  def check_capture(self, capture: Iterable[str], num_layers: int) -> None:
    """ValueError naming the captures that need attention probabilities when the forward's op
    does not give them (before anything is compiled)."""
    if self.attentions:
      return
    from MaxText.layers import sites  # pylint: disable=import-outside-toplevel
    wanted = [c for c in capture if c == "attentions" or any(
        sites.parse(n)[0] in sites.HEAD_SITES for n in
        (sites.expand(c, num_layers) if c not in ("hidden_states", "logits") else []))]
    if wanted:
      raise ValueError(f"capture {wanted} needs attention probabilities, which only the "
                       f"reference (dot-product) attention materialises; this model's forward "
                       f"runs attention={self.attention_op!r} (load it with "
                       f"attention='reference')")


def attention_op(mcfg: ModelConfig, setting: str) -> str:
  """The op the inspected forward runs for an attention setting (ValueError naming a bad one)."""
  if setting not in ATTENTION_SETTINGS:
    raise ValueError(f"attention={setting!r}: one of {ATTENTION_SETTINGS}")
  return REFERENCE_OP if setting == "reference" else mcfg.attention


def capabilities_of(mcfg: ModelConfig, *, attention: str = "reference", chat: bool = False,
                    processor_takes: Iterable[str] = ()) -> Capabilities:
  """The capabilities of a model of `mcfg` (no parameters needed): `chat` whether its tokenizer has
  chat templates, `processor_takes` the modalities its checkpoint's processor prepares."""
  from MaxText.models.registry import get_family  # pylint: disable=import-outside-toplevel
  family = get_family(mcfg.decoder_block)
  op = attention_op(mcfg, attention)
  towers = set(family.media(mcfg)) & set(processor_takes)
  decodes = family.decode_cache is not None
  return Capabilities(generate=decodes, logprobs=decodes, hidden_states=True, logits=True,
                      attentions=op == REFERENCE_OP, gradients=True, interventions=True,
                      chat=chat, images="image" in towers, audio="audio" in towers,
                      lora=not mcfg.weight_bits, attention_op=op)
