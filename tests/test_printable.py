"""Text made safe for logs (MaxText/data/printable.py) and the decode CLI's display of it."""
from MaxText import decode
from MaxText.data.printable import printable, visible_spaces


def test_control_characters_are_escaped_newlines_and_tabs_kept():
  assert printable("a\x00b\x1b[31mc\r\n\td") == "a\\x00b\\x1b[31mc\\r\n\td"
  assert printable("\u2028 \udc80 \ue000") == "\\u2028 \\udc80 \\ue000"   # separator, surrogate, private
  assert printable("é 日本 😀") == "é 日本 😀"                          # printable text is unchanged


def test_a_token_label_shows_its_spaces():
  assert visible_spaces(" the") == "\u2423the"
  assert visible_spaces("\n\x00") == "\\n\\x00"


def test_decode_shows_escaped_text_without_trailing_whitespace_or_ids_without_a_tokenizer():
  assert decode.shown("a\x00b  \n\n  ", [5], "continued by the model") == (
      "continued by the model:\n  | a\\x00b")
  assert decode.shown("x\ny", [5], "prompt") == "prompt:\n  | x\n  | y"
  assert decode.shown(None, [1, 5, 9], "prompt") == "prompt:\n  | 1 5 9"
  assert decode.shown(" \n", [7, 8], "continued by the model") == (
      "continued by the model: no text (ids 7 8)")
  assert decode.shown("a\n\nb", [5], "prompt") == "prompt:\n  | a\n  |\n  | b"
