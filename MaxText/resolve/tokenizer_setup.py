"""The run's tokenizer, settled before anything compiles and written into config.yml resolved.

- `tokenizer_type` / `tokenizer_path` are resolved by `data.tokenizers.resolve` (auto: byte
  without a path, else the kind of the file; a directory's tokenizer.json or *.model).
- Fine-tuning (`load_parameters_path`) without a `tokenizer_path`: the checkpoint's own tokenizer
  files (`checkpoint/tokenizer_files.py`) are used, and the log says so.
- A checkpoint whose vocabulary came from a real tokenizer (it carries tokenizer files, or its
  config names a huggingface/sentencepiece tokenizer) refuses `tokenizer_type=byte`: byte ids
  would mean nothing to that model.
- Such a checkpoint without its tokenizer files (a Hugging Face folder that had none) needs
  `tokenizer_path` wherever text is tokenized; a run that tokenizes nothing (`dataset_type=
  synthetic` without `eval_dataset_path`) goes without one: its config keeps the tokenizer type
  with an empty path (so its checkpoints still say the vocabulary is a real tokenizer's), the
  data config check returns no tokenizer and the run's samples say there is none.
"""
from __future__ import annotations

from MaxText.checkpoint import tokenizer_files
from MaxText.checkpoint.manager import read_meta, resolve_step_dir
from MaxText.config.load import ConfigError, replace
from MaxText.config.schema import Config
from MaxText.data import tokenizers

FILE_TYPES = ("huggingface", "sentencepiece")


class MissingTokenizer(ConfigError):
  """The model's vocabulary is a real tokenizer's whose files are not at hand (exit 2 wherever
  text must be tokenized; decoding token ids needs none)."""


def tokenizes_nothing(cfg: Config) -> bool:
  """Whether a training run of `cfg` reads no text: synthetic token rows, no evaluation files."""
  return cfg.dataset_type == "synthetic" and not (cfg.eval_period and cfg.eval_dataset_path)


def choose_tokenizer(cfg: Config) -> tuple[Config, str]:
  """(`cfg` with tokenizer_type and tokenizer_path resolved, a log line saying which and why).
  Raises ConfigError / DataError (exit 2) naming the key."""
  origin = ""
  if cfg.load_parameters_path:
    try:
      step_dir = resolve_step_dir(cfg.load_parameters_path)
      saved = read_meta(cfg.load_parameters_path)["config"].get("tokenizer_type", "byte")
    except FileNotFoundError as e:
      raise ConfigError(f"load_parameters_path: {e}") from None
    folder = tokenizer_files.in_checkpoint(step_dir)
    if folder is not None or saved in FILE_TYPES:
      what = (f"its tokenizer is in {folder}" if folder else
              f"its {saved} tokenizer files are not in the checkpoint")
      if cfg.tokenizer_type == "byte":
        raise ConfigError(
            f"tokenizer_type=byte: the model at load_parameters_path={cfg.load_parameters_path} "
            f"has the vocabulary of a real tokenizer ({what}); byte ids would mean nothing to it. "
            "Leave tokenizer_type and tokenizer_path unset to use the checkpoint's tokenizer")
      if not cfg.tokenizer_path:
        if folder is None and tokenizes_nothing(cfg):
          return replace(cfg, tokenizer_type=saved if saved in FILE_TYPES else "huggingface",
                         tokenizer_path=""), (
              f"tokenizer: none (the model at load_parameters_path={cfg.load_parameters_path} "
              f"has the vocabulary of a real tokenizer but {what}; dataset_type=synthetic never "
              "tokenizes, so none is needed)")
        if folder is None:
          raise MissingTokenizer(
              f"tokenizer_path: the model at load_parameters_path={cfg.load_parameters_path} has "
              f"the vocabulary of a real tokenizer but {what}; set tokenizer_path to it")
        cfg = replace(cfg, tokenizer_path=folder)
        origin = "; the checkpoint's own, from load_parameters_path"
  kind, path, how = tokenizers.resolve(cfg.tokenizer_type, cfg.tokenizer_path)
  cfg = replace(cfg, tokenizer_type=kind, tokenizer_path=path)
  return cfg, f"tokenizer: {kind}{' ' + path if path else ''} ({how}{origin})"
