"""Data pipeline: tokenizers, document sources, packing and the resumable batch iterator.

Entry points: ``DataConfig`` (the schema's data keys, typed), ``validate_data_config`` (the
pre-flight checks of a DataConfig; returns the tokenizer) and ``make_shard_iterator`` /
``make_data_iterator`` (training batches).

The iterator and the pre-flight checks (grain, jax) are imported when first named, so that a module
which needs only this package's light parts — ``DataError``, ``DataConfig``, the tokenizers — does
not pay for them: a tool answers ``--help`` and refuses a bad key before jax is imported.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from MaxText.data.config import DataConfig
from MaxText.data.errors import DataError
from MaxText.data.batch import BATCH_KEYS
from MaxText.data.tokenizers import (ByteTokenizer, HFTokenizer, SentencePieceTokenizer,
                                     Tokenizer, make_tokenizer)

if TYPE_CHECKING:
  from MaxText.data.pipeline import DataIterator, make_data_iterator, make_shard_iterator
  from MaxText.data.validation import validate_data_config

__all__ = [
    "BATCH_KEYS", "ByteTokenizer", "DataConfig", "DataError", "DataIterator",
    "HFTokenizer", "SentencePieceTokenizer", "Tokenizer", "make_data_iterator",
    "make_shard_iterator", "make_tokenizer", "validate_data_config",
]


def __getattr__(name: str) -> Any:
  """The iterator's and the pre-flight checks' names, imported on first use (PEP 562)."""
  # pylint: disable=import-outside-toplevel
  if name in ("DataIterator", "make_data_iterator", "make_shard_iterator"):
    from MaxText.data import pipeline
    return getattr(pipeline, name)
  if name == "validate_data_config":
    from MaxText.data import validation
    return validation.validate_data_config
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
