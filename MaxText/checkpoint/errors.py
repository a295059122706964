"""The exception for checkpoints that cannot be used or written (exit status 4)."""


class CheckpointError(RuntimeError):
  """A checkpoint is damaged, incomplete or incompatible, or a save failed or hung.

  Messages name the step and, where one is to blame, the array or file.
  """
