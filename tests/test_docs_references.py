"""Cross-references stay inside the repository and resolve: every ``docs/<page>.md#<anchor>`` cited in code, tests
or docs (and every relative link between doc pages) names an existing page and one of its headings, and nothing
points at documents or data outside the checkout."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

TEXT_SUFFIXES = {".py", ".md", ".sh", ".toml", ".yaml", ".yml", ".txt", ".cfg", ".ini", ".html"}
CITATION = re.compile(r"\b(docs/[\w./-]+\.md)(?:#([\w-]+))?")
DOC_LINK = re.compile(r"\]\(([\w./-]+\.md)(?:#([\w-]+))?\)")
# Built from parts so that this file does not match itself.
OUTSIDE = re.compile("|".join([r"\.\./" + "shared", "shared/" + "reference", "shared/" + "data", r"\bspec " + "\u00a7"]))


def tracked_text_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
    paths = [REPO_ROOT / line for line in listed.splitlines() if not line.startswith("tests/fixtures/")]
    return [p for p in paths if p.suffix in TEXT_SUFFIXES and p.is_file()]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.+?)\s*$", text, re.M)}


def references() -> list[tuple[str, Path, str | None]]:
    found = []
    for path in tracked_text_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        where = str(path.relative_to(REPO_ROOT))
        for match in CITATION.finditer(text):
            found.append((where, REPO_ROOT / match.group(1), match.group(2)))
        if path.suffix == ".md":
            for match in DOC_LINK.finditer(text):
                target = match.group(1)
                if not target.startswith(("http", "docs/")):
                    found.append((where, (path.parent / target).resolve(), match.group(2)))
    return found


def test_the_docs_cite_pages_and_anchors_that_exist() -> None:
    cited = references()
    assert any(anchor for _, _, anchor in cited), "no anchored citation found: the pattern is broken"
    broken = [f"{where}: {target.relative_to(REPO_ROOT)}#{anchor}" for where, target, anchor in cited
              if not target.is_file() or (anchor and anchor not in anchors(target))]
    assert broken == []


@pytest.mark.parametrize("heading, expected", [("Speaker embedding (x-vector)", "speaker-embedding-x-vector"),
                                               ("`config.py` and layout", "configpy-and-layout")])
def test_slug_follows_github(heading: str, expected: str) -> None:
    assert slug(heading) == expected


def test_nothing_refers_outside_the_repository() -> None:
    offending = []
    for path in tracked_text_files():
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                offending.append(f"{path.relative_to(REPO_ROOT)}:{number}: {line.strip()}")
    assert offending == []
