"""Whether a tool's held-out share is the one the run behind a checkpoint held out.

`eval_split_fraction=f` holds out an evenly spread share f of the dataset's documents
(`data/sources.py: held_out`); which documents depends on f alone. A training run saves its config
with every checkpoint, so a tool reading the same dataset keys (`DATA_KEYS`) from its
`load_parameters_path` can tell whether its share is the run's:

- `MaxText.evaluate` with a share f > 0 that differs from the run's evaluates (in part) on
  documents the run trained on: refused (exit 2) with the fix. With f = 0 it evaluates on every
  document, as asked, and says that the run trained on them (all, or all but its share).
- `MaxText.quantize` calibrates on the training split of its share; when the run held out a share
  f' > 0 and the calibration's differs, calibration would read held-out documents (which later
  evaluations then see through the quantized weights): refused with the fix.

A conversion's config (to_maxtext: the meta entry `hf_source`) says nothing about what its weights
were trained on, nor does a config whose dataset keys differ from the tool's (another dataset),
and `eval_dataset_path` is a held-out source of its own: none of these is checked.
"""
from __future__ import annotations

from MaxText.checkpoint.manager import hf_source, read_meta
from MaxText.config.load import ConfigError
from MaxText.config.schema import KEYS, Config
from MaxText.storage import paths

DATA_KEYS = ("dataset_type", "dataset_path", "dataset_format", "dataset_text_field", "sft")


def _same(key: str, saved, now) -> bool:
  if key == "dataset_path":
    norm = lambda p: paths.absolute(p) if p else ""
    return norm(saved) == norm(now)
  return saved == now


def run_share(cfg: Config) -> float | None:
  """The eval_split_fraction of the training run that wrote `cfg.load_parameters_path` when it
  read the same dataset keys as `cfg`; None when there is nothing to compare (no checkpoint, a
  conversion, another dataset, an eval_dataset_path)."""
  path = cfg.load_parameters_path
  if not path or cfg.eval_dataset_path or hf_source(path):
    return None
  saved = read_meta(path)["config"]
  if not all(_same(k, saved.get(k, KEYS[k].default), getattr(cfg, k)) for k in DATA_KEYS):
    return None
  return float(saved.get("eval_split_fraction", KEYS["eval_split_fraction"].default))


def trained_on(path: str) -> dict:
  """The dataset keys and held-out share of the run that trained the checkpoint at `path` (from
  its saved config), for a checkpoint made from it (`MaxText.quantize`) to carry in its own
  config: the checks here then compare with what its weights were trained on, not with the
  command that made it (a GPTQ calibration's share); {} for a conversion (nothing to carry)."""
  if hf_source(path):
    return {}
  saved = read_meta(path)["config"]
  return {k: saved.get(k, KEYS[k].default) for k in (*DATA_KEYS, "eval_split_fraction")}


def check_evaluation(cfg: Config) -> str | None:
  """ConfigError when `MaxText.evaluate`'s held-out share is not the run's; else a note to print
  (None: nothing to say)."""
  ran, now = run_share(cfg), cfg.eval_split_fraction
  if ran is None:
    return None
  where = f"the run that wrote load_parameters_path={cfg.load_parameters_path}"
  if now > 0 and now != ran:
    fix = (f"set eval_split_fraction={ran:g} (its held-out share)" if ran > 0 else
           "give eval_dataset_path= data it never read, or eval_split_fraction=0 to evaluate on "
           "every document (all trained on)")
    raise ConfigError(
        f"eval_split_fraction={now:g}: {where} trained on these dataset keys with "
        f"eval_split_fraction={ran:g}, so "
        + ("it read every document of this share" if ran == 0 else
           "this share is not the one it held out (part of it was in its training stream)")
        + f"; {fix}")
  if now == 0:
    return (f"note: evaluating on every document of the dataset keys; {where} trained on "
            + (f"all but its eval_split_fraction={ran:g} share (set that to evaluate on the "
               "held-out documents only)" if ran > 0 else "all of them"))
  return None


def check_calibration(cfg: Config) -> None:
  """ConfigError when quantize's calibration share differs from the run's held-out share."""
  ran, now = run_share(cfg), cfg.eval_split_fraction
  if ran is None or ran == 0 or now == ran:
    return
  raise ConfigError(
      f"eval_split_fraction={now:g}: the run that wrote load_parameters_path="
      f"{cfg.load_parameters_path} held out eval_split_fraction={ran:g} of these dataset keys' "
      "documents, and calibration with another share would read some of them; set "
      f"eval_split_fraction={ran:g}")
