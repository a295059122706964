"""Pallas kernels (flash attention)."""
from MaxText.kernels.flash_attention import flash_attention

__all__ = ["flash_attention"]
