"""Builds a tiny random-init Hugging Face model for the end_to_end parity scripts and saves it
(safetensors + config.json, as `save_pretrained` writes it). Weights that initialise to a constant
are perturbed (+0.1 N(0, 1)) so that a scale `w`, its `1 + w` variant or a forgotten factor cannot
look alike: parameters whose name contains "norm" or ends with one of `perturb_suffixes`, and
buffers ending with one of `buffer_suffixes`.

  save_tiny(folder, "Qwen3Config", "Qwen3ForCausalLM", vocab_size=384, ...)
"""
from __future__ import annotations


def save_tiny(folder: str, config_cls: str, model_cls: str, *, seed: int = 0,
              perturb_suffixes: tuple[str, ...] = (), buffer_suffixes: tuple[str, ...] = (),
              **config) -> None:
  import torch
  import transformers
  torch.manual_seed(seed)
  model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**config))
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name or (perturb_suffixes and name.endswith(perturb_suffixes)):
        p.add_(0.1 * torch.randn_like(p))
    for name, b in model.named_buffers():
      if buffer_suffixes and name.endswith(buffer_suffixes):
        b.add_(0.1 * torch.randn_like(b))
  model.save_pretrained(folder)
