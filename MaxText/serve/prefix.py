"""Prefix caching over the slots' own cache rows: which tokens each slot's row holds, and the
longest prefix of a new prompt that one of them can give it.

A slot's row keeps what its last request wrote after the request leaves (and while it runs): the
K/V (or state) of `held[slot]`, its prompt and the tokens it fed back. A new prompt that starts
with a row's tokens need not prefill them: the scheduler copies that row into the new request's
slot (`Slots.copy`; nothing to copy when the row is a free slot's: the request takes that slot)
and prefills only the rest, as a piece that continues at the shared length (chunked prefill's
piece, every family). What can be reused depends on the family's cache (`positional`):
  full attention only   a row's first m positions are the first m tokens' K/V whatever came
                        after them: any common prefix m of the row's tokens and the prompt
  sliding rings, a      the row is the state after all of its tokens only: reused when the
  recurrent state       prompt starts with all of them (a conversation's next turn)
At least one prompt token is always prefilled (its logits choose the first new token), and a
reuse shorter than `minimum` tokens is not worth a copy. A prompt with images or audio never
reuses (its soft tokens are not in the token ids).
"""
from __future__ import annotations


def common_prefix(a: list[int], b: list[int]) -> int:
  n = min(len(a), len(b))
  return next((i for i in range(n) if a[i] != b[i]), n)


class PrefixIndex:
  """The tokens each of `slots` rows holds (module docstring); `positional`: whether any prefix
  of a row is reusable (full attention only), else all of it only."""

  def __init__(self, slots: int, positional: bool, minimum: int):
    self.positional, self.minimum = positional, max(1, minimum)
    self.held: list[list[int]] = [[] for _ in range(slots)]
    self.used = [0] * slots          # when each slot last took a request (0: never)
    self.clock = 0

  def reusable(self, slot: int, prompt: list[int]) -> int:
    """How many of `prompt`'s first tokens row `slot` can give (0: none)."""
    held = self.held[slot]
    if self.positional:
      m = common_prefix(held, prompt[:-1])
    else:
      m = len(held) if len(held) < len(prompt) and prompt[:len(held)] == held else 0
    return m if m >= self.minimum else 0

  def place(self, prompt: list[int] | None, free: list[int]) -> tuple[int, int, int]:
    """(the free slot the request takes, the slot whose row it reuses or -1, the tokens reused).
    `prompt` None: no reuse. A free slot that holds the best prefix is taken itself; else the
    least recently used free slot (its row the least likely to be asked for again)."""
    target = min(free, key=lambda s: self.used[s])
    if prompt is None:
      return target, -1, 0
    m, source = max((self.reusable(s, prompt), s) for s in range(len(self.held)))
    if m == 0:
      return target, -1, 0
    if source in free or self.reusable(target, prompt) == m:
      target = source if source in free else target
      return target, target, m
    return target, source, m

  def took(self, slot: int, kept: int) -> None:
    """`slot` took a request that reuses its row's first `kept` tokens (0: it will write anew)."""
    self.clock += 1
    self.used[slot] = self.clock
    self.held[slot] = self.held[slot][:kept]

  def copied(self, source: int, slot: int, kept: int) -> None:
    self.held[slot] = self.held[source][:kept]

  def wrote(self, slot: int, tokens: list[int]) -> None:
    """`tokens` fed to `slot`'s row after what it held (a prompt piece, a decoding call's)."""
    self.held[slot] = self.held[slot] + tokens
