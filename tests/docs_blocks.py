"""The fenced code blocks of a docs page, so a test runs the command or snippet the page gives,
exactly as written (docs must match code)."""
import os
import re
import shlex

from conftest import ROOT

_FENCE = re.compile(r"^(\s*)(```|~~~)(\S*)\s*$")


def page(name: str) -> str:
  with open(os.path.join(ROOT, "docs", name), encoding="utf-8") as f:
    return f.read()


def blocks(text: str, section: str | None = None) -> list[tuple[str, str]]:
  """(language, body) of each fenced block in `text`, or in its section whose heading starts with
  `section` (up to the next heading of the same or a higher level); bodies dedented by the fence's
  own indentation."""
  lines = text.splitlines()
  if section is not None:
    start = next(i for i, line in enumerate(lines) if re.match(r"#+ " + re.escape(section), line))
    level = len(lines[start]) - len(lines[start].lstrip("#"))
    end = next((i for i in range(start + 1, len(lines))
                if re.match(r"#{1,%d} " % level, lines[i])), len(lines))
    lines = lines[start:end]
  out, body, lang, indent = [], None, "", ""
  for line in lines:
    m = _FENCE.match(line)
    if m and body is None:
      indent, lang, body = m.group(1), m.group(3), []
    elif m and body is not None:
      out.append((lang, "\n".join(body)))
      body = None
    elif body is not None:
      body.append(line[len(indent):] if line.startswith(indent) else line)
  return out


def commands(body: str) -> list[str]:
  """The shell commands of a block: backslash continuations joined, comment lines dropped."""
  joined = re.sub(r"\\\n\s*", "", body)
  return [line.strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def split_command(command: str) -> tuple[dict[str, str], list[str]]:
  """(the VAR=value assignments in front, the argv after them)."""
  words = shlex.split(command)
  env = {}
  while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
    k, v = words.pop(0).split("=", 1)
    env[k] = v
  return env, words
