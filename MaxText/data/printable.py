"""Text made safe for a log or a terminal: a model's output (a byte-level model's above all) may
hold control bytes — NUL, escape sequences, carriage returns — that make `grep` call the log
binary or rewrite the terminal. `printable` escapes them as Python does (`\\x00`, `\\x1b`, `\\r`,
`\\u2028`), keeping newlines and tabs; `visible_spaces` also shows the spaces of a short label
(a token: `␣the`)."""
from __future__ import annotations

import unicodedata

_KEPT = frozenset("\n\t")
# control, surrogate (undecodable bytes kept by surrogateescape), private use, unassigned, and
# the line / paragraph separators that terminals and editors break lines at
_ESCAPED_CATEGORIES = frozenset(("Cc", "Cs", "Co", "Cn", "Zl", "Zp"))


def _escape(ch: str) -> str:
  code = ord(ch)
  if ch == "\r":
    return "\\r"
  if code < 0x100:
    return f"\\x{code:02x}"
  return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable(text: str) -> str:
  """`text` with every unprintable character escaped (newlines and tabs kept)."""
  return "".join(ch if ch in _KEPT or unicodedata.category(ch) not in _ESCAPED_CATEGORIES
                 else _escape(ch) for ch in text)


def visible_spaces(label: str) -> str:
  """A token's text as a label: unprintables escaped (newlines and tabs too, as `\\n`, `\\t`),
  spaces shown as `␣` so that " the" and "the" differ."""
  return printable(label).replace("\n", "\\n").replace("\t", "\\t").replace(" ", "\u2423")
