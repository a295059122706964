"""The exception types raised by the data pipeline for user-fixable problems."""


class DataError(ValueError):
  """A data/tokenizer config key has a bad value (missing path, bad format, ...).

  Messages always name the offending config key and value, e.g.
  ``tokenizer_path '/x/y' does not exist``.
  """


class RecordError(DataError):
  """One record cannot be read (bad JSON, no text field, ...); the message names its place (``<file>
  line <n>``, ``row <i>``, ``record <i>``)."""


class BadRecordsError(DataError):
  """The data itself is bad, not a key — more than `max_bad_records` bad records, a file that is
  not of its format — so exit 3 (bad data) wherever it is found: in the records read before
  compiling (`probe.py`) or later."""
