"""README as a front page (issue 58 point 1): at most 150 lines, the two commands first, every relative link to a file
that exists. The docs site itself is built by ``make docs`` (MkDocs ``--strict``: CI's third step)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_is_a_front_page_whose_links_resolve():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150
    assert lines[3].startswith("make demo") and lines[4].startswith("make test")  # README's first commands
    targets = re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", "\n".join(lines))
    local = [t for t in targets if not t.startswith(("http://", "https://"))]
    assert local and [t for t in local if not (ROOT / t).exists()] == []
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md"))
    assert [p for p in pages if p not in nav] == []  # every page is reachable from the site's navigation
