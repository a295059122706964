"""Data pipeline: tokenizers, document sources, packing and the resumable batch iterator.

Entry points: ``make_data_iterator`` (training batches) and ``validate_data_config``
(cheap pre-flight checks of the data config keys).
"""

from MaxText.data.errors import DataError
from MaxText.data.packing import BATCH_KEYS
from MaxText.data.pipeline import DataIterator, make_data_iterator, make_shard_iterator
from MaxText.data.tokenizers import (ByteTokenizer, HFTokenizer, SentencePieceTokenizer,
                                     Tokenizer, make_tokenizer)
from MaxText.data.validation import DATA_CONFIG_KEYS, validate_data_config

__all__ = [
    "BATCH_KEYS", "ByteTokenizer", "DATA_CONFIG_KEYS", "DataError", "DataIterator",
    "HFTokenizer", "SentencePieceTokenizer", "Tokenizer", "make_data_iterator",
    "make_shard_iterator", "make_tokenizer", "validate_data_config",
]
