"""The checks of the data config that the schema cannot make, run once before anything compiles.

Paths are resolved and stat-ed; of the data itself only the first records of the first file are
read (probe.py: a dataset of the wrong format is refused here, not after the compile). The
tokenizer is loaded (it is small) so its vocabulary can be checked against ``vocab_size``; the
caller keeps it and hands it to the pipeline, so a run loads it once.
"""

from __future__ import annotations

from MaxText.data import probe
from MaxText.data import sft
from MaxText.data import sources
from MaxText.data import tokenizers
from MaxText.data.config import DataConfig
from MaxText.data.errors import DataError
from MaxText.data.synthetic import FIRST_TOKEN


def validate_data_config(dcfg: DataConfig) -> tokenizers.Tokenizer | None:
  """Checks `dcfg` against the file system, its tokenizer and the first records of its data.

  Returns:
    The tokenizer the config names (loaded to check its vocabulary size); None for synthetic data
    of a model whose tokenizer files are not at hand (`tokenizers.is_absent`).

  Raises:
    DataError: naming the first bad key (missing path, tokenizer larger than ``vocab_size``, a
      bos/eos the tokenizer lacks, ...); BadRecordsError (a DataError: exit 3) when more than
      `max_bad_records` of the first records are bad (probe.py).
  """
  if dcfg.dataset_type == "synthetic":
    if dcfg.vocab_size <= FIRST_TOKEN:
      raise DataError(f"vocab_size={dcfg.vocab_size} must be > {FIRST_TOKEN} for dataset_type "
                      "'synthetic'")
    if tokenizers.is_absent(dcfg.tokenizer_type, dcfg.tokenizer_path):
      return None   # a model whose tokenizer files are not at hand: nothing here needs them
    # Synthetic rows never use the tokenizer's ids.
    return tokenizers.make_tokenizer(dcfg.tokenizer_type, dcfg.tokenizer_path)
  # the data files first, whatever the tokenizer (SFT's checks below need a chat tokenizer): a path
  # that names no file is reported as such in every trainer (issue 58)
  files = (sources.resolve_dataset_files(dcfg.dataset_path, dcfg.dataset_format)
           if dcfg.dataset_type == "file" else [])
  tokenizer = tokenizers.make_tokenizer(dcfg.tokenizer_type, dcfg.tokenizer_path)

  if tokenizer.vocab_size > dcfg.vocab_size:
    raise DataError(f"tokenizer has {tokenizer.vocab_size} ids but vocab_size={dcfg.vocab_size}; "
                    "raise vocab_size to at least the tokenizer's size")
  if dcfg.sft:
    if dcfg.dataset_type != "file" or not isinstance(tokenizer, tokenizers.HFTokenizer):
      raise DataError("sft=true reads chat records from jsonl files with a Hugging Face tokenizer: "
                      f"set dataset_type=file (now {dcfg.dataset_type!r}) and tokenizer_type="
                      f"huggingface (now {dcfg.tokenizer_type!r})")
    sft.ChatFormat.for_tokenizer(dcfg.tokenizer_path, dcfg.chat_template_path)
    probe.check_first_chat_records(sft.record_files(dcfg.dataset_path, dcfg.dataset_format),
                                   sft.messages_of, dcfg.max_bad_records)
    return tokenizer
  # plain text only: in SFT the chat template writes the special tokens (add_bos / add_eos do not
  # apply there)
  for key, token, token_id in (("add_bos", "bos_token", tokenizer.bos_id),
                               ("add_eos", "eos_token", tokenizer.eos_id)):
    if getattr(dcfg, key) and token_id is None:
      if isinstance(tokenizer, tokenizers.HFTokenizer):
        where = (f"neither {' nor '.join(tokenizers.SPECIAL_TOKEN_FILES)} next to it sets "
                 f"\"{token}\"; set it there, or set {key}=false")
      else:
        where = f"the model defines none; set {key}=false"
      raise DataError(f"{key}=true but the tokenizer {tokenizer!r} has no {token} ({where})")
  if dcfg.dataset_type == "file":
    if any(fmt != "text" for _, fmt in files) and not dcfg.dataset_text_field:
      raise DataError(f"dataset_text_field {dcfg.dataset_text_field!r} must name the text field of "
                      f"the {sorted({fmt for _, fmt in files} - {'text'})} files")
    probe.check_first_records(files, dcfg.dataset_text_field, dcfg.max_bad_records)
  return tokenizer
