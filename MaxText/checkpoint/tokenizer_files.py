"""The tokenizer travels with the model: its files live in a checkpoint as the item `tokenizer/`.

- A Hugging Face folder's tokenizer files (`NAMES` and any SentencePiece `*.model`: tokenizer.json,
  tokenizer_config.json with its chat template, special_tokens_map.json, chat_template.jinja, ...)
  and a multimodal model's processor files (processor_config.json, preprocessor_config.json:
  MaxText/data/multimodal/processor.py reads them beside the tokenizer) are copied into the
  checkpoint by `to_maxtext`, and back out next to config.json by `to_huggingface`, so
  `transformers.AutoTokenizer` (and `AutoProcessor`) loads the export.
- A training run whose tokenizer is a file saves that file (as `tokenizer.json` for a HuggingFace
  one) and its companions from the same folder into every checkpoint step.
- `train.py load_parameters_path=CKPT` uses the checkpoint's tokenizer unless `tokenizer_path`
  says otherwise (`MaxText/resolve/tokenizer_setup.py`).

Files are copied as they are (never parsed here) and are part of the step's manifest.
"""
from __future__ import annotations

import dataclasses
import os

import jax
import orbax.checkpoint as ocp
from etils import epath

from MaxText.storage import paths

ITEM = "tokenizer"
NAMES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
         "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt",
         "processor_config.json", "preprocessor_config.json")
_ORBAX_FILES = ("_CHECKPOINT_METADATA", "commit_success.txt")


def files_of(folder: str) -> dict[str, str]:
  """{name: path} of the tokenizer files in a folder (a Hugging Face model or tokenizer folder)."""
  present = set(paths.listdir(folder))
  found = {n: paths.join(folder, n) for n in NAMES if n in present}
  found.update({n: paths.join(folder, n) for n in sorted(present) if n.endswith(".model")})
  return found


def files_for(tokenizer_type: str, tokenizer_file: str) -> dict[str, str]:
  """What a run with this (resolved) tokenizer saves: the file itself (a HuggingFace one named
  tokenizer.json) and the companion files of its folder (special tokens, chat template)."""
  if tokenizer_type not in ("huggingface", "sentencepiece") or not tokenizer_file:
    return {}
  folder = os.path.dirname(os.path.abspath(tokenizer_file))
  companions = {n: p for n, p in files_of(folder).items()
                if n in NAMES and n not in ("tokenizer.json", "vocab.json", "merges.txt")}
  name = "tokenizer.json" if tokenizer_type == "huggingface" else os.path.basename(tokenizer_file)
  return {**companions, name: tokenizer_file}


def copy(files: dict[str, str], folder: str) -> list[str]:
  """Copies {name: source} into `folder` (created; either may be on an object store); returns the
  names."""
  paths.makedirs(folder)
  for name, src in files.items():
    paths.copy_file(src, paths.join(folder, name))
  return sorted(files)


def in_checkpoint(step_dir: str) -> str | None:
  """The tokenizer folder of a checkpoint step, or None when the step carries no tokenizer."""
  folder = paths.join(step_dir, ITEM)
  return folder if files_of(folder) else None


def export(step_dir: str, output_dir: str) -> list[str]:
  """Writes a checkpoint step's tokenizer files into a Hugging Face folder; returns their names."""
  folder = in_checkpoint(step_dir)
  if folder is None:
    return []
  names = [n for n in sorted(paths.files_under(folder))
           if "/" not in n and n not in _ORBAX_FILES and not n.startswith(".")]
  return copy({n: paths.join(folder, n) for n in names}, output_dir)


class TokenizerFilesHandler(ocp.CheckpointHandler):
  """The `tokenizer` item: process 0 copies the files (they are the same on every process)."""

  def save(self, directory: epath.Path, args: "TokenizerFilesSave") -> None:
    if jax.process_index() == 0:
      copy(args.files, os.fspath(directory))

  def restore(self, directory: epath.Path, args: "TokenizerFilesRestore | None" = None
              ) -> list[str]:
    return sorted(files_of(os.fspath(directory)))

  def metadata(self, directory: epath.Path) -> None:
    return None


@ocp.args.register_with_handler(TokenizerFilesHandler, for_save=True)
@dataclasses.dataclass
class TokenizerFilesSave(ocp.args.CheckpointArgs):
  files: dict  # {name in the checkpoint: source path}


@ocp.args.register_with_handler(TokenizerFilesHandler, for_restore=True)
@dataclasses.dataclass
class TokenizerFilesRestore(ocp.args.CheckpointArgs):
  pass
