"""The model keys only the Qwen3-Next family reads: its Gated DeltaNet (linear-attention)
layers (the multi-token-prediction keys are shared: config/schema.py).

Composed into the one schema like every family's `keys.py` (docs/architecture.md, the family
section).
"""
from __future__ import annotations

from dataclasses import dataclass

from MaxText.config.spec import ModelUse, Section, key
from MaxText.config.tools import CONVERT, MODEL_TOOLS

_COMPUTE = ModelUse(model=True, arch=False)   # read by the model, but the parameters mean the same
SECTION = Section(section="model: qwen3_next (MaxText/models/qwen3_next/keys.py)",
                  section_tools=(*MODEL_TOOLS, *CONVERT))


@dataclass(frozen=True, kw_only=True)
class Keys:
  linear_num_key_heads: int = key(
      0, "q/k heads of the linear layers (0 = none)", min=0, model=True,
      note="Linear-attention layers (Gated DeltaNet, Qwen3-Next; MaxText/layers/gated_delta.py): the "
      "layers marked l in attention_pattern.",
      **SECTION)
  linear_num_value_heads: int = key(0, "value heads of the linear layers (a multiple of the key "
                                    "heads)", min=0, model=True)
  linear_key_head_dim: int = key(0, "q/k head width of the linear layers", min=0, model=True)
  linear_value_head_dim: int = key(0, "value head width of the linear layers", min=0, model=True)
  linear_conv_kernel_dim: int = key(4, "width of the causal depthwise conv over q|k|v", min=1,
                                    model=True)
  linear_chunk_size: int = key(64, "tokens per chunk of the chunked gated delta rule (training)",
                               min=1, **_COMPUTE, tools=MODEL_TOOLS)
  linear_recurrence: str = key("chunked", "chunked (training) | token (one token at a time: the "
                               "reference form, slow)", choices=("chunked", "token"), **_COMPUTE,
                               tools=MODEL_TOOLS)
