"""A tokenizer's own chat template, rendered as transformers' `apply_chat_template(messages,
add_generation_prompt=True, tokenize=False)` renders it.

Where the template is (transformers' order): `chat_template.jinja` next to the tokenizer, else the
`chat_template` of `chat_template.json`, else of `tokenizer_config.json` (a string, or a list of
{"name", "template"} whose "default" is taken). How it is rendered: jinja2's sandboxed environment
with trim_blocks and lstrip_blocks, the loop-controls extension, a `{% generation %}` block that
renders its body, `tojson` without HTML escaping, `raise_exception`, `strftime_now`, and the
tokenizer's special tokens (bos_token, eos_token, ...) as variables. The rendered text is then
tokenized without adding special tokens (the template writes them).
"""
from __future__ import annotations

import datetime
import json
import os
from typing import Any, Sequence

from MaxText.data import tokenizers
from MaxText.data.errors import DataError

CONFIG_FILES = ("chat_template.json", "tokenizer_config.json")
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                  "mask_token")


def find_template(folder: str) -> str:
  """The chat template of the tokenizer in `folder`; DataError when it has none."""
  jinja = os.path.join(folder, "chat_template.jinja")
  if os.path.isfile(jinja):
    with open(jinja, encoding="utf-8") as f:
      return f.read()
  for name in CONFIG_FILES:
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
      continue
    template = tokenizers.json_object(path).get("chat_template")
    if isinstance(template, list):
      named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
      template = named.get("default")
      if template is None:
        raise DataError(f"{path}: the chat templates are named {sorted(map(str, named))}, none "
                        "'default'")
    if isinstance(template, str):
      return template
  raise DataError(f"chat=true but the tokenizer in {folder} has no chat template (no "
                  f"chat_template.jinja, and no chat_template in {' or '.join(CONFIG_FILES)})")


def special_tokens(folder: str) -> dict[str, str]:
  """{bos_token: "<s>", ...} as the template sees them, read as transformers reads them
  (`tokenizers.special_tokens`)."""
  return tokenizers.special_tokens(folder, SPECIAL_TOKENS)[0]


def _environment(marks: tuple[str, str] = ("", "")):
  import jinja2  # pylint: disable=import-outside-toplevel
  from jinja2 import ext, nodes
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  class Generation(ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks assistant text for training): its body,
    between `marks` (none by default; data/sft.py finds the assistant text by them)."""
    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
      return marks[0] + caller() + marks[1]

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[Generation, ext.loopcontrols])
  env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, \
      sort_keys=False: json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                                  separators=separators, sort_keys=sort_keys)
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env


def render(template: str, messages: Sequence[dict[str, Any]], tokens: dict[str, str], *,
           add_generation_prompt: bool = True, generation_marks: tuple[str, str] = ("", ""),
           tools: Sequence[dict] | None = None, template_kwargs: dict[str, Any] | None = None
           ) -> str:
  """The template applied to `messages` ([{"role", "content"}, ...]), with `tools` (JSON schemas
  of the functions the model may call) and `template_kwargs` (the template's own variables, e.g.
  enable_thinking) as transformers' `apply_chat_template(tools=, **kwargs)` hands them; DataError
  when the template does not parse or refuses the messages (its raise_exception)."""
  import jinja2  # pylint: disable=import-outside-toplevel
  if not isinstance(messages, (list, tuple)) or not all(
      isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
    raise DataError(f"chat messages must be a list of {{'role': ..., 'content': ...}} objects, "
                    f"got {messages!r:.200}")
  try:
    compiled = _environment(generation_marks).from_string(template)
    if tools is not None and not (isinstance(tools, (list, tuple)) and
                                  all(isinstance(t, dict) for t in tools)):
      raise DataError(f"tools must be a list of JSON-schema objects, got {tools!r:.200}")
    return compiled.render(messages=list(messages), tools=None if tools is None else list(tools),
                           documents=None, add_generation_prompt=add_generation_prompt,
                           **{**tokens, **(template_kwargs or {})})
  except jinja2.exceptions.TemplateError as e:
    raise DataError(f"the chat template cannot render these messages: {e}") from e
