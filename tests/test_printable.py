"""Text made safe for logs (MaxText/data/printable.py) and the decode CLI's display of it."""
import ast

from MaxText import decode
from MaxText.data.printable import printable, visible_spaces


def test_control_characters_are_escaped_newlines_and_tabs_kept():
  assert printable("a\x00b\x1b[31mc\r\n\td") == "a\\x00b\\x1b[31mc\\r\n\td"
  assert printable("\u2028 \udc80 \ue000") == "\\u2028 \\udc80 \\ue000"   # separator, surrogate, private
  assert printable("é 日本 😀") == "é 日本 😀"                          # printable text is unchanged


def test_a_token_label_shows_its_spaces():
  assert visible_spaces(" the") == "\u2423the"
  assert visible_spaces("\n\x00") == "\\n\\x00"


def test_decode_shows_escaped_text_its_trailing_white_space_quoted_or_ids_without_a_tokenizer():
  assert decode.shown("a\x00b  \n\n  ", [5], "continued by the model") == (
      "continued by the model:\n  | a\\x00b\n  (then 6 white-space characters: '  \\n\\n  ')")
  assert decode.shown("x\ny", [5], "prompt") == "prompt:\n  | x\n  | y"
  assert decode.shown(None, [1, 5, 9], "prompt") == "prompt:\n  | 1 5 9"
  assert decode.shown(" \n", [7, 8], "continued by the model") == (
      "continued by the model: white space only, ' \\n' (ids 7 8)")
  assert decode.shown("", [], "continued by the model") == "continued by the model: no text (ids none)"
  # a byte-level model's 32 tokens, "e" and 31 of white space: all 32 are on the screen
  text = "e" + " \n" * 15 + " "
  printed = decode.shown(text, [0] * 32, "continued by the model")
  head, note = printed.split("\n  (then 31 white-space characters: ")
  assert head == "continued by the model:\n  | e" and ast.literal_eval(note[:-1]) == text[1:]
  assert decode.shown("a\n\nb", [5], "prompt") == "prompt:\n  | a\n  |\n  | b"
