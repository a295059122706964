"""The model keys only the llama family reads (DeepSeek-style dense-then-MoE layers).

Declared here, in the family's folder, and composed into the one schema by
`MaxText.config.schema.add_keys` (the schema imports this module through the family table,
`MaxText/models/families.py`): validated, shown by `--help`, rendered into configs/base.yml and
fields of `Config` and `ModelConfig` like every other key. Imports nothing above the config
package (tests/test_layering.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from MaxText.config.spec import key
from MaxText.config.tools import CONVERT, MODEL_TOOLS

SECTION = dict(section="model: llama (MaxText/models/llama/keys.py)",
               section_tools=(*MODEL_TOOLS, *CONVERT))


@dataclass(frozen=True, kw_only=True)
class Keys:
  first_k_dense_layers: int = key(0, "the first k layers have a dense MLP (DeepSeek style)", min=0,
                                  model=True, **SECTION)
