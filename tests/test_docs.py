"""The README and docs/ stay in step: every page under docs/ is linked from the README, every relative link in
the README and in docs/ reaches a file that exists, and the README stays a first screen (issue 39)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
DOCS = ROOT / "docs"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")  # [text](target): a Markdown link or image


def _relative_links(page: Path) -> list[str]:
    """The page's link targets that are files of this repository (no URL, no bare #anchor), anchors dropped."""
    targets = [m.group(1) for m in LINK.finditer(page.read_text(encoding="utf-8"))]
    return [t.split("#", 1)[0] for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def test_the_readme_links_every_docs_page():
    linked = {(ROOT / t).resolve() for t in _relative_links(ROOT / "README.md")}
    missing = sorted(p.name for p in DOCS.glob("*.md") if p.resolve() not in linked)
    assert not missing, f"docs/ pages the README does not link (add them to its Documentation table): {missing}"


@pytest.mark.parametrize("page", [ROOT / "README.md", *sorted(DOCS.glob("*.md"))], ids=lambda p: p.name)
def test_every_relative_link_reaches_a_file(page):
    broken = [t for t in _relative_links(page) if not (page.parent / t).exists()]
    assert not broken, f"{page.relative_to(ROOT)} links to files that do not exist: {broken}"


def test_the_readme_is_a_first_screen():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 250, f"README.md has {lines} lines: move the detail into a docs/ page and link it"
