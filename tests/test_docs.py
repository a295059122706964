"""The prose stays navigable: every relative link of README.md, docs/*.md and benchmarks/RESULTS.md
points at a file that exists (and, for a `#fragment` into Markdown, at one of its headings), every
repository path the prose names in backticks (`MaxText/...`, `benchmarks/...`, ...) exists, so a
moved module cannot leave the docs behind, and README.md stays a front page, with the detail on the
docs/ pages."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README_MAX_LINES = 220
RESULTS_MAX_LINES = 500   # one section per benchmark, its latest figures
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^\s*(```|~~~)")


def _prose_lines(text):
  """The lines outside fenced code blocks, with inline code removed."""
  in_fence = False
  for line in text.splitlines():
    if _FENCE.match(line):
      in_fence = not in_fence
      continue
    if not in_fence:
      yield re.sub(r"`[^`]*`", "", line)


def links(text):
  return [m.group(1) for line in _prose_lines(text) for m in _LINK.finditer(line)]


def anchors(text):
  """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
  seen, out = {}, set()
  in_fence = False
  for line in text.splitlines():
    if _FENCE.match(line):
      in_fence = not in_fence
      continue
    m = None if in_fence else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
    if m:
      slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
      n = seen.get(slug, 0)
      seen[slug] = n + 1
      out.add(slug if n == 0 else f"{slug}-{n}")
  return out


def broken_links(md_path, root=ROOT):
  problems = []
  for target in links(md_path.read_text()):
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
      continue
    path_part, _, fragment = target.partition("#")
    dest = (md_path.parent / path_part).resolve() if path_part else md_path
    if not dest.exists():
      problems.append(f"{md_path.relative_to(root)}: ({target}) -> {dest} does not exist")
    elif fragment and dest.suffix == ".md" and fragment not in anchors(dest.read_text()):
      problems.append(f"{md_path.relative_to(root)}: ({target}) -> no heading #{fragment} in {dest.name}")
  return problems


DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "RESULTS.md"] + sorted((ROOT / "docs").glob("*.md"))


@pytest.mark.parametrize("md_path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_existing_files(md_path):
  assert broken_links(md_path) == []


_REPO_PATH = re.compile(r"`((?:MaxText|benchmarks|tests|configs|end_to_end|docs)/[^`\s:()]*)")


def missing_paths(text):
  """Repository paths named in backticks that do not exist (placeholders such as `<family>` and
  globs skipped)."""
  paths = (m.group(1).rstrip(".,;") for m in _REPO_PATH.finditer(text))
  return [p for p in paths if not re.search(r"[<>*{}]", p) and not (ROOT / p).exists()]


@pytest.mark.parametrize("md_path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_repository_paths_named_in_the_docs_exist(md_path):
  assert missing_paths(md_path.read_text()) == [], md_path.relative_to(ROOT)


def test_readme_is_a_front_page():
  n = len((ROOT / "README.md").read_text().splitlines())
  assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move detail to docs/"


def test_results_holds_the_current_figures_only():
  n = len((ROOT / "benchmarks" / "RESULTS.md").read_text().splitlines())
  assert n <= RESULTS_MAX_LINES, (f"benchmarks/RESULTS.md has {n} lines (at most "
                                  f"{RESULTS_MAX_LINES}): replace superseded figures, git keeps them")


def test_the_checker_finds_broken_links(tmp_path):
  (tmp_path / "other.md").write_text("# A heading, with `code`\n\n## Twice\n## Twice\n")
  page = tmp_path / "page.md"
  page.write_text("[ok](other.md) [ok](other.md#a-heading-with-code) [ok](other.md#twice-1)\n"
                  "[gone](missing.md) [bad anchor](other.md#nope) [web](https://example.com)\n"
                  "```\n[in a fence](fenced.md)\n```\n`[inline](inline.md)`\n")
  problems = broken_links(page, root=tmp_path)
  assert len(problems) == 2 and "missing.md" in problems[0] and "#nope" in problems[1], problems


def test_the_checker_finds_moved_paths():
  text = ("`MaxText/no_such_module.py`, `MaxText/models/<family>/model.py`, `tests/test_docs.py::x`, "
          "`MaxText/config/schema.py: key`")
  assert missing_paths(text) == ["MaxText/no_such_module.py"]


PAGES = sorted((ROOT / "docs").glob("*.md"))
_COMMAND = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S+\s+)*(?:\.venv/bin/python|bash)\s")


def first_block(text):
  """(the lines of the page's first fenced block, whether it comes before the first ## heading)."""
  lines, seen_h2 = text.splitlines(), False
  for i, line in enumerate(lines):
    if line.startswith("## "):
      seen_h2 = True
    if _FENCE.match(line):
      end = next(j for j in range(i + 1, len(lines)) if _FENCE.match(lines[j]))
      return lines[i + 1:end], not seen_h2
  return [], False


@pytest.mark.parametrize("md_path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_page_opens_with_a_runnable_recipe(md_path):
  """Each docs page opens (before its first section) with a command to run: its first line that is
  not a comment runs the venv's python or bash (after VAR=value assignments)."""
  body, opens = first_block(md_path.read_text())
  assert opens, f"{md_path.name}: no fenced block before the first ## heading"
  lines = [line for line in body if line.strip() and not line.lstrip().startswith("#")]
  assert lines and _COMMAND.match(lines[0]), f"{md_path.name}: {lines[:1]}"


def test_the_checker_wants_a_command_first():
  assert first_block("# T\n\nintro\n\n```\n# a comment\n.venv/bin/python x.py\n```\n## A\n") == (
      ["# a comment", ".venv/bin/python x.py"], True)
  assert first_block("# T\n\n## A\n\n```python\nimport x\n```\n")[1] is False
  assert not _COMMAND.match("import openai") and _COMMAND.match("MAXTEXT_API_KEY=s .venv/bin/python -m x")


def test_the_unread_key_training_md_names_is_refused_and_hf_path_is_read():
  """docs/training.md's example of a key train.py does not read is refused (exit 2, naming the
  programs that read it); hf_path, which train.py does read (docs/models.md), is not."""
  from MaxText.config.load import ConfigError, check_read_by, load_config
  text = (ROOT / "docs" / "training.md").read_text()
  [key] = re.findall(r"does not read \(`(\w+)=` for\s+train\.py", text)
  base = str(ROOT / "configs" / "base.yml")
  default = load_config([base], keep_auto=True)
  value = {"temperature": "0.7"}.get(key, "x")
  with pytest.raises(ConfigError, match=f"{key}=.*train.py does not read {key}"):
    load_config([base, f"{key}={value}"], keep_auto=True, tool="train")
  check_read_by(load_config([base, "hf_path=/nowhere"], keep_auto=True), "train")
  assert default.hf_path == ""
