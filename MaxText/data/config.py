"""The data pipeline's typed config: the schema's keys marked `data=True`
(MaxText/config/schema.py) as a frozen dataclass. `DataConfig.from_config(cfg)` takes them from the
run's `Config`, whose types and ranges were checked when it was loaded; `validate_data_config` adds
the checks that look at the file system and the tokenizer, once per start."""
from __future__ import annotations

from typing import TYPE_CHECKING

from MaxText.config.schema import DATA_KEYS, View, view

if TYPE_CHECKING:   # the class the type checker reads: its fields (MaxText/config/views_generated.py)
  from MaxText.config.views_generated import DataConfigKeys

  class DataConfig(DataConfigKeys, View):
    pass
else:
  DataConfig = view("DataConfig", DATA_KEYS, __name__)
