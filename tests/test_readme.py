"""README.md is a newcomer's page, and every link in it and in docs/ leads somewhere.

The README stays short (the rest lives in docs/), keeps the two marked commands
that .ci/run and tests/test_docs_run.py read, and links every page in docs/.
A relative link in README.md or docs/*.md must name a file in the tree, and a
``#fragment`` into a markdown file must name one of its headings (as GitHub
makes a heading's anchor).
"""

from __future__ import annotations

import re
from pathlib import Path

from test_docs_commands import DOCS, ROOT, marked_blocks

README = ROOT / "README.md"
MAX_LINES = 150

_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6} +(.+?) *$", re.M)


def links_in(markdown: str) -> list[str]:
    """The targets of the markdown links outside fenced code."""
    return _LINK.findall(_FENCE.sub("", markdown))


def anchors_of(markdown: str) -> set[str]:
    """The anchors GitHub gives a text's headings: lower case, punctuation dropped, spaces as
    hyphens, a repeated one numbered."""
    seen: dict[str, int] = {}
    anchors = set()
    for heading in _HEADING.findall(_FENCE.sub("", markdown)):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def broken_links(doc: Path, root: Path = ROOT) -> list[str]:
    """The relative links of ``doc`` that name no file under ``root``, or no heading of the file."""
    broken = []
    for target in links_in(doc.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        to = (doc.parent / path).resolve() if path else doc
        there = to.is_file() and root.resolve() in to.parents
        if not there or (anchor and to.suffix == ".md" and anchor not in anchors_of(to.read_text())):
            broken.append(target)
    return broken


def test_the_readme_is_short() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; the rest belongs in docs/"


def test_the_readme_has_the_two_commands() -> None:
    text = README.read_text()
    [demo] = marked_blocks(text, "demo-command")
    [tests] = marked_blocks(text, "test-command")
    for block in (demo, tests):
        assert block.count("\n") == 1 and block.startswith("python3 -m venv .venv && "), block
    assert demo.rstrip().endswith("&& minifaas demo")
    assert " && pytest " in tests


def test_the_readme_links_every_doc() -> None:
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in links_in(README.read_text())}
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in linked]
    assert missing == [], f"README.md links no {missing}"


def test_every_link_resolves() -> None:
    broken = {doc.name: b for doc in DOCS if (b := broken_links(doc))}
    assert broken == {}, f"links to no file or heading: {broken}"


def test_link_checks(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# Title\n\n## 1. Run `x`, then y\n\n## Title\n")
    doc = tmp_path / "b.md"
    doc.write_text(
        "[ok](a.md#1-run-x-then-y) [ok](a.md#title-1) [web](https://example.org/x)\n"
        "```\n[in code](nowhere.md)\n```\n[no file](c.md) [no heading](a.md#none) [outside](../a.md)\n"
    )
    assert anchors_of((tmp_path / "a.md").read_text()) == {"title", "1-run-x-then-y", "title-1"}
    assert links_in(doc.read_text()) == ["a.md#1-run-x-then-y", "a.md#title-1", "https://example.org/x",
                                         "c.md", "a.md#none", "../a.md"]  # fmt: skip
    (tmp_path.parent / "a.md").write_text("# Title\n")  # a file that is there, but outside the tree
    assert broken_links(doc, tmp_path) == ["c.md", "a.md#none", "../a.md"]
