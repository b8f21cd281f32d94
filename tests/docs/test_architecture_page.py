"""docs/architecture.md is a guided path through real files: every file it names
exists, and each path it follows stays at most 12 files long."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[2]
PAGE = ROOT / "docs" / "architecture.md"
NAMED = re.compile(r"`((?:core|plugins|protocols|contrib)/[\w/]+\.py)`")


def _sections() -> dict[str, str]:
    parts = re.split(r"^## ", PAGE.read_text(), flags=re.M)
    return {part.splitlines()[0]: part for part in parts[1:]}


def test_every_file_the_page_names_exists():
    named = set(NAMED.findall(PAGE.read_text()))
    assert len(named) >= 12
    missing = sorted(path for path in named if not (ROOT / path).is_file())
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"


def test_each_guided_path_has_at_most_12_files_in_order():
    paths = {title: body for title, body in _sections().items() if "|---|" in body}
    assert len(paths) >= 2  # offline and served
    for title, body in paths.items():
        rows = re.findall(r"^\| (\d+) \| `([^`]+)` \|", body, flags=re.M)
        numbers = [int(n) for n, _ in rows]
        assert numbers == list(range(1, len(rows) + 1)), title
        assert 1 < len({f for _, f in rows}) <= 12, title
