"""Shared pieces of the decoding tests: an Engine on some of the fake devices, the tiny HF models of
the parity tests (converted to our parameters), and transformers' greedy generation as the oracle."""
from __future__ import annotations

import jax
import numpy as np

from conftest import BASE_YML
from MaxText.config.load import load_config
from MaxText.decoding.engine import Engine
from MaxText.models.model_config import ModelConfig
from MaxText.sharding.mesh import create_mesh
from MaxText.sharding.rules import parse_rules

MESH_1 = ("ici_fsdp_parallelism=1",)
# 8 devices: batch over data, heads / MLP over tensor, experts over expert
MESH_8 = ("ici_data_parallelism=2", "ici_fsdp_parallelism=1", "ici_expert_parallelism=2",
          "ici_tensor_parallelism=2")


def engine(mcfg: ModelConfig, mesh_args=MESH_1, **kw) -> Engine:
  """An Engine for `mcfg` on the mesh `mesh_args` describe (1 or 8 fake CPU devices)."""
  cfg = load_config([BASE_YML, *mesh_args])
  devices = jax.devices()[:1] if mesh_args == MESH_1 else jax.devices()
  mesh = create_mesh(cfg, devices)
  return Engine(mcfg, mesh, parse_rules(cfg.logical_axis_rules, cfg.mesh_axes), **kw)


def family_models():
  """{name: (HF model, (mcfg, model_def, params from its state dict))} of the parity tests:
  Qwen3, Qwen3-MoE (all layers sparse), Gemma 4 with every feature (sliding window 4, a KV-shared
  tail), the Gemma 4 MoE shape and Qwen3-Next ([3 Gated DeltaNet + 1 gated attention], dense MLPs:
  a random MoE's routing flips on near ties at the rounding noise of its linear layers)."""
  import test_gemma4_parity as gemma4
  import test_qwen3_next_parity as qwen3_next
  import test_qwen3_moe_parity as qwen3_moe
  import test_qwen3_parity as qwen3
  return {"qwen3": (lambda: qwen3.hf_model(False), lambda: qwen3.ours(False, True)),
          "qwen3_moe": (lambda: qwen3_moe.hf_model("sparse"), lambda: qwen3_moe.ours("sparse")),
          "gemma4": (lambda: gemma4.hf_model("all"), lambda: gemma4.ours("all", True)),
          "gemma4_moe": (lambda: gemma4.hf_model("moe"), lambda: gemma4.ours("moe", True)),
          "qwen3_next": (lambda: qwen3_next.hf_model("dense"),
                         lambda: qwen3_next.ours("dense", True))}


def hf_greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
  """transformers' generate(do_sample=False) of a batch of prompts (left-padded, with the attention
  mask, as transformers batches prompts of different lengths), never stopping at an eos (the
  model's own generation config has none; `min_new_tokens` would instead forbid the eos token)."""
  import torch
  model.generation_config.eos_token_id = None
  width = max(map(len, prompts))
  ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts])
  mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
  with torch.no_grad():
    out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                         pad_token_id=0)[:, width:].tolist()
  assert all(len(o) == new_tokens for o in out)
  return out


def hf_next_logits(model, tokens: list[int]) -> np.ndarray:
  import torch
  with torch.no_grad():
    return model(torch.tensor([tokens]), use_cache=False).logits[0, -1].float().numpy()


def log_softmax(x: np.ndarray) -> np.ndarray:
  x = x.astype(np.float64)
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))
