"""The one table of the model families in this repository: `decoder_block` → the module whose
`FAMILY` defines the family (MaxText/models/registry.py imports it the first time the family is
asked for). Beside it, a family's `keys.py` (when it has one) declares the model keys only that
family reads; the schema (MaxText/config/schema.py) composes those into the one `Config` by this
table, which is why it stands alone here and imports nothing.
"""

FAMILY_MODULES: dict[str, str] = {
    "llama": "MaxText.models.llama.family",
    "gemma4": "MaxText.models.gemma4.family",
    "qwen3_next": "MaxText.models.qwen3_next.family",
}
