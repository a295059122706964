"""The one exception type raised by the data pipeline for user-fixable problems."""


class DataError(ValueError):
  """A data/tokenizer config key has a bad value (missing path, bad format, ...).

  Messages always name the offending config key and value, e.g.
  ``tokenizer_path '/x/y' does not exist``.
  """
