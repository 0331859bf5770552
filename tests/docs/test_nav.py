"""mkdocs.yml's nav lists every docs/ page and names no page that is missing (``make docs`` builds with
``--strict``; this cheap check runs in ``make test`` without mkdocs installed)."""
from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def nav_pages(entries) -> list[str]:
    """The page paths in a mkdocs nav (nested lists of ``{title: path or [...]}`` and bare paths)."""
    pages = []
    for entry in entries:
        values = entry.values() if isinstance(entry, dict) else [entry]
        for value in values:
            pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_docs_page_is_in_the_nav_and_every_nav_entry_exists():
    config = yaml.load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=yaml.BaseLoader)
    listed = nav_pages(config["nav"])
    assert len(listed) == len(set(listed)), f"pages listed twice: {sorted(p for p in listed if listed.count(p) > 1)}"
    on_disk = {str(page.relative_to(ROOT / "docs")) for page in (ROOT / "docs").rglob("*.md")}
    assert sorted(set(listed) - on_disk) == [], "nav entries without a page"
    assert sorted(on_disk - set(listed)) == [], "docs pages missing from mkdocs.yml's nav"


def test_readme_links_into_docs_exist():
    import re

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(((?:docs/|tests/|BENCHMARKS)[^)#]*)", readme)
    assert links and not [link for link in links if not (ROOT / link).is_file()]
