"""The model keys only the llama family reads (DeepSeek-style dense-then-MoE layers).

Composed into the one schema like every family's `keys.py` (docs/architecture.md, the family
section).
"""
from __future__ import annotations

from dataclasses import dataclass

from MaxText.config.spec import Section, key
from MaxText.config.tools import CONVERT, MODEL_TOOLS

SECTION = Section(section="model: llama (MaxText/models/llama/keys.py)",
                  section_tools=(*MODEL_TOOLS, *CONVERT))


@dataclass(frozen=True, kw_only=True)
class Keys:
  first_k_dense_layers: int = key(0, "the first k layers have a dense MLP (DeepSeek style)", min=0,
                                  model=True, **SECTION)
