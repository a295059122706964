"""Preference optimization (python -m MaxText.dpo): MaxText/dpo/__main__.py."""
