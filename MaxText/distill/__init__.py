"""Distillation (python -m MaxText.distill): MaxText/distill/__main__.py."""
