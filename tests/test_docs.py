"""The documentation a newcomer reads first: README stays small and every link in README and docs/ resolves."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)  # quoted terminal output is not markdown


def _prose(doc: Path) -> str:
    return FENCE.sub("", doc.read_text())


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_readme_is_small():
    assert (ROOT / "README.md").stat().st_size < 8 * 1024


def test_every_relative_link_resolves_to_a_file_of_the_repo():
    bad = []
    for doc in _docs():
        for target, _anchor in LINK.findall(_prose(doc)):
            if "://" in target:
                continue
            if not (doc.parent / target).resolve().exists():
                bad.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not bad, bad
    assert len(LINK.findall((ROOT / "README.md").read_text())) >= 4  # the parser does see README's links
