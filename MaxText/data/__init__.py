"""Data pipeline: tokenizers, document sources, packing and the resumable batch iterator.

Entry points: ``DataConfig`` (the schema's data keys, typed), ``validate_data_config`` (the
pre-flight checks of a DataConfig; returns the tokenizer) and ``make_shard_iterator`` /
``make_data_iterator`` (training batches).
"""

from MaxText.data.config import DataConfig
from MaxText.data.errors import DataError
from MaxText.data.batch import BATCH_KEYS
from MaxText.data.pipeline import DataIterator, make_data_iterator, make_shard_iterator
from MaxText.data.tokenizers import (ByteTokenizer, HFTokenizer, SentencePieceTokenizer,
                                     Tokenizer, make_tokenizer)
from MaxText.data.validation import validate_data_config

__all__ = [
    "BATCH_KEYS", "ByteTokenizer", "DataConfig", "DataError", "DataIterator",
    "HFTokenizer", "SentencePieceTokenizer", "Tokenizer", "make_data_iterator",
    "make_shard_iterator", "make_tokenizer", "validate_data_config",
]
