"""lm-evaluation-harness on our models: the `maxtext` model (`model.MaxTextLM`) in lm-eval's own
model registry, and lm-eval's command line with it (`python -m MaxText.lmeval`, `__main__.py`).

lm-eval finds a model by name in `lm_eval.api.registry.model_registry`; it reads no entry points,
so the documented way for a model outside its tree is to register it (`@register_model`) in the
process that runs the evaluation. Importing this package does that, lazily (the name points at
`MaxText.lmeval.model:MaxTextLM`, imported when lm-eval first asks for it):

  import MaxText.lmeval   # noqa: F401  (registers "maxtext")
  import lm_eval
  lm_eval.simple_evaluate(model="maxtext", model_args="load_parameters_path=CKPT", tasks=[...])

lm-eval's own models are put in the registry first: `get_model` fills an empty registry with
them, and a registry holding only ours would never be filled (`--model hf` would be unknown).
"""
from __future__ import annotations

NAME = "maxtext"
TARGET = "MaxText.lmeval.model:MaxTextLM"


def register() -> None:
  """Puts `maxtext` in lm-eval's model registry (after lm-eval's own models); idempotent."""
  import lm_eval.models  # noqa: F401  # pylint: disable=import-outside-toplevel  (lm-eval's table)
  from lm_eval.api.registry import model_registry  # pylint: disable=import-outside-toplevel
  if NAME not in model_registry:
    model_registry.register(NAME, target=TARGET)


register()
