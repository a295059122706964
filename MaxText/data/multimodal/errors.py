"""The error of an image or audio input that cannot be read (exit 3 in the tools)."""


class MediaError(Exception):
  """An image or audio clip that cannot be read or prepared: a missing file, a file that is not an
  image / a WAV clip, an array of the wrong kind. The message names the file or the input."""
