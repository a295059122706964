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
