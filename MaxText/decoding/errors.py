"""The error of a model or request that cannot be decoded (exit 2 in the tools, 4xx in the server):
its own light module, so that a tool names it in its exit contract without importing the engine."""


class InferenceError(ValueError):
  """A model or request that cannot be decoded: the message names the key, prompt or number."""
