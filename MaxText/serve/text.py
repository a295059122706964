"""A completion's text as its tokens arrive: what can be sent now, and where a stop string ends it.

The text of the tokens so far is decoded whole each time (a tokenizer's text of a prefix can change
at its end: a byte-level BPE's partial UTF-8 character is U+FFFD until its last byte comes), and
only a settled prefix is released: never a trailing U+FFFD, and with stop strings never the last
(longest stop - 1) characters, which could begin one. A stop string ends the completion before it
(the OpenAI API's rule: the stop string is not part of the text); the tokens keep the one that
completed it. So the streamed pieces concatenate to exactly the text a non-streamed request gets.
"""
from __future__ import annotations

from typing import Callable, Sequence


class TextStream:
  """The text of one completion; `push` its tokens, then `finish` (module docstring)."""

  def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()):
    self.decode = decode
    self.stop = [s for s in stop if s]
    self.hold = max((len(s) for s in self.stop), default=1) - 1
    self.ids: list[int] = []
    self.text = ""
    self.sent = 0               # characters released so far
    self.stopped = False

  def push(self, ids: Sequence[int]) -> str:
    """The text released by the tokens `ids` (appended); sets `stopped` when a stop string ends
    the completion (the text is then final)."""
    if self.stopped:
      return ""
    self.ids.extend(int(i) for i in ids)
    self.text = self.decode(self.ids)
    ends = [i for i in (self.text.find(s, max(0, self.sent - self.hold)) for s in self.stop)
            if i >= 0]
    if ends:
      self.text = self.text[:min(ends)]
      self.stopped = True
      return self._release(len(self.text))
    safe = len(self.text) - self.hold
    while safe > self.sent and self.text[safe - 1] == "\ufffd":
      safe -= 1
    return self._release(safe)

  def push_each(self, ids: Sequence[int]) -> tuple[str, int]:
    """`push` one token at a time, stopping at the one that completes a stop string: (the text
    released, how many of `ids` were taken)."""
    out = []
    for n, t in enumerate(ids, 1):
      out.append(self.push([t]))
      if self.stopped:
        return "".join(out), n
    return "".join(out), len(ids)

  def finish(self) -> str:
    """The rest of the text (the completion ended)."""
    return self._release(len(self.text))

  def _release(self, upto: int) -> str:
    piece = self.text[self.sent:upto] if upto > self.sent else ""
    self.sent = max(self.sent, upto)
    return piece
