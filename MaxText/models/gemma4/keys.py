"""The model keys only the Gemma 4 family reads (full-layer geometry, kv sharing, per-layer
input embeddings, the logit soft cap).

Composed into the one schema like every family's `keys.py` (docs/architecture.md, the family
section).
"""
from __future__ import annotations

from dataclasses import dataclass

from MaxText.config.spec import key
from MaxText.config.tools import CONVERT, MODEL_TOOLS

SECTION = dict(section="model: gemma4 (MaxText/models/gemma4/keys.py)",
               section_tools=(*MODEL_TOOLS, *CONVERT))


@dataclass(frozen=True, kw_only=True)
class Keys:
  attention_scale: float = key(0.0, "multiplier of q.k; 0 = 1/sqrt(head_dim)", min=0, model=True,
                               **SECTION)
  global_head_dim: int = key(0, "head width on full layers (0 = head_dim)", min=0, model=True)
  global_num_kv_heads: int = key(0, "kv heads on full layers (0 = num_kv_heads)", min=0,
                                 model=True)
  global_rope_theta: float = key(0.0, "RoPE base on full layers (0 = rope_theta)", min=0,
                                 model=True)
  global_rope_fraction: float = key(
      1.0, "share of channel pairs rotated on full layers (proportional RoPE)", gt=0, max=1,
      model=True)
  attention_k_eq_v: bool = key(False, "full layers have no value projection: V = the raw key "
                               "projection", model=True)
  num_kv_shared_layers: int = key(0, "the last N layers reuse K/V of the last earlier layer of "
                                  "their kind", min=0, model=True)
  double_wide_mlp_on_shared: bool = key(False, "the kv-shared layers have a 2 x mlp_dim MLP",
                                        model=True)
  per_layer_input_dim: int = key(0, "per-layer input embeddings (PLE) width; 0 = off", min=0,
                                 model=True)
  per_layer_input_vocab_size: int = key(0, "rows of the PLE table (0 = vocab_size)", min=0,
                                        model=True)
  final_logit_softcap: float = key(0.0, "logits = c * tanh(logits / c) before the loss; 0 = off",
                                   min=0, model=True)
