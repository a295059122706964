"""Cheap checks of the data config keys, run before anything is compiled.

Nothing here reads a dataset: paths are resolved and stat-ed only. The tokenizer
is loaded (it is small) so its vocabulary can be checked against ``vocab_size``.
"""

from __future__ import annotations

from typing import Any

from MaxText.data import sources
from MaxText.data import tokenizers
from MaxText.data.errors import DataError

# Every config attribute the data pipeline reads.
DATA_CONFIG_KEYS = (
    "dataset_type", "dataset_path", "dataset_format", "dataset_text_field",
    "tokenizer_type", "tokenizer_path", "add_bos", "add_eos", "packing", "shuffle",
    "data_shuffle_seed", "grain_worker_count", "max_target_length", "vocab_size",
    "max_bad_records",
)


def get_key(cfg: Any, key: str) -> Any:
  """``cfg.<key>``, or DataError naming the key if the config lacks it."""
  try:
    return getattr(cfg, key)
  except AttributeError:
    raise DataError(f"config has no key '{key}' (the data pipeline needs it)") from None


def _int_key(cfg: Any, key: str, low: int, high: int | None = None) -> int:
  value = get_key(cfg, key)
  if isinstance(value, bool) or not isinstance(value, int):
    raise DataError(f"{key}={value!r} must be an integer")
  if value < low or (high is not None and value >= high):
    bound = f">= {low}" if high is None else f"in [{low}, {high})"
    raise DataError(f"{key}={value} must be {bound}")
  return value


def _bool_key(cfg: Any, key: str) -> bool:
  value = get_key(cfg, key)
  if not isinstance(value, bool):
    raise DataError(f"{key}={value!r} must be true or false")
  return value


def validate_data_config(cfg: Any) -> tokenizers.Tokenizer:
  """Checks the data keys of `cfg` without reading any dataset.

  Returns:
    The tokenizer the config names (loaded to check its vocabulary size).

  Raises:
    DataError: naming the first bad key (missing path, unknown type/format,
      tokenizer larger than ``vocab_size``, out-of-range integer, ...).
  """
  for key in DATA_CONFIG_KEYS:
    get_key(cfg, key)
  for key in ("add_bos", "add_eos", "packing", "shuffle"):
    _bool_key(cfg, key)
  _int_key(cfg, "max_target_length", 1)
  vocab_size = _int_key(cfg, "vocab_size", 1)
  _int_key(cfg, "data_shuffle_seed", 0, 2**32)
  _int_key(cfg, "grain_worker_count", 0)
  _int_key(cfg, "max_bad_records", 0)

  dataset_type = get_key(cfg, "dataset_type")
  if dataset_type not in sources.DATASET_TYPES:
    raise DataError(f"dataset_type '{dataset_type}' is not one of {list(sources.DATASET_TYPES)}")
  tokenizer = tokenizers.make_tokenizer(get_key(cfg, "tokenizer_type"),
                                        get_key(cfg, "tokenizer_path"))
  if dataset_type == "synthetic":
    if vocab_size <= 3:
      raise DataError(f"vocab_size={vocab_size} must be > 3 for dataset_type 'synthetic'")
    return tokenizer  # Synthetic rows never use the tokenizer's ids.

  if tokenizer.vocab_size > vocab_size:
    raise DataError(f"tokenizer has {tokenizer.vocab_size} ids but vocab_size={vocab_size}; "
                    "raise vocab_size to at least the tokenizer's size")
  for key, token, token_id in (("add_bos", "bos_token", tokenizer.bos_id),
                               ("add_eos", "eos_token", tokenizer.eos_id)):
    if get_key(cfg, key) and token_id is None:
      if isinstance(tokenizer, tokenizers.HFTokenizer):
        where = (f"neither {' nor '.join(tokenizers.SPECIAL_TOKEN_FILES)} next to it sets "
                 f"\"{token}\"; set it there, or set {key}=false")
      else:
        where = f"the model defines none; set {key}=false"
      raise DataError(f"{key}=true but the tokenizer {tokenizer!r} has no {token} ({where})")

  if dataset_type == "file":
    files = sources.resolve_dataset_files(get_key(cfg, "dataset_path"),
                                          get_key(cfg, "dataset_format"))
    field = get_key(cfg, "dataset_text_field")
    needs_field = any(fmt != "text" for _, fmt in files)
    if needs_field and (not isinstance(field, str) or not field):
      raise DataError(f"dataset_text_field {field!r} must name the text field of the "
                      f"{sorted({fmt for _, fmt in files} - {'text'})} files")
  return tokenizer
