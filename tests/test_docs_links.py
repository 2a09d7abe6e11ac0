"""The documentation points only at files inside the repository (issue 14).

Independent truth: the file system. Every relative Markdown link in docs/ resolves to a file
of the repository, and no page or docstring under docs/, src/ or scripts/ sends the reader to
REFERENCES.md or the workspace's shared folder, which are not part of the repository.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKED = [
    p
    for folder in ("docs", "src", "scripts")
    for p in sorted((ROOT / folder).rglob("*"))
    if p.suffix in (".md", ".py", ".toml", ".txt", ".sh") and "egg-info" not in str(p)
]
OUTSIDE = re.compile(r"REFERENCES\.md|/work/shared|\.\./shared")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _id(p: Path) -> str:
    return str(p.relative_to(ROOT))


def test_the_checked_files_are_found():
    names = {_id(p) for p in CHECKED}
    assert {"docs/bench.md", "docs/data.md", "src/posenc/cli.py"} <= names


@pytest.mark.parametrize("path", CHECKED, ids=_id)
def test_no_reference_to_files_outside_the_repository(path):
    hits = [f"{i}: {line.strip()}" for i, line in enumerate(path.read_text().splitlines(), 1) if OUTSIDE.search(line)]
    assert hits == []


@pytest.mark.parametrize("path", sorted((ROOT / "docs").rglob("*.md")), ids=_id)
def test_relative_markdown_links_resolve(path):
    broken = []
    for target in LINK.findall(path.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a web address or an anchor on the same page
        file = (path.parent / target.split("#")[0]).resolve()
        if not (file.is_file() and file.is_relative_to(ROOT)):
            broken.append(target)
    assert broken == []
