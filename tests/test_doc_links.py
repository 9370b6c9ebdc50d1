"""Every relative link of README.md and docs/ (recursively) leads somewhere: the file exists, and an anchor
(``file.md#heading``) names a heading of that file as GitHub makes its anchors. And the run-config reference
(docs/configuration.md) names every key the app declares."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from doc_blocks import DOCS, ROOT

#: Pages linked before they exist, each with the reason; once the page exists its entry must go (the test says so).
PENDING: dict[str, str] = {}

_LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^\s*(`{3,}|~{3,})")


def _prose(doc: Path) -> list[str]:
    """The lines of ``doc`` outside fenced blocks."""
    out, fence = [], None
    for line in doc.read_text().splitlines():
        match = _FENCE.match(line)
        if fence is None and match:
            fence = match.group(1)
        elif fence is not None and line.strip().startswith(fence) and not line.strip().strip(fence[0]):
            fence = None
        elif fence is None:
            out.append(line)
    return out


def anchors(doc: Path) -> set[str]:
    """The anchors GitHub gives the headings of ``doc``: lower case, punctuation but ``-`` and ``_`` dropped, spaces
    as ``-``, a repeated heading numbered ``-1``, ``-2``..."""
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(doc):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(doc: Path) -> list[str]:
    """The relative link targets of ``doc``'s prose (web addresses left out)."""
    out = []
    for line in _prose(doc):
        line = re.sub(r"`[^`]*`", "", line)
        for match in _LINK.finditer(line):
            target = match.group(1) or match.group(2)
            if not re.match(r"^[a-z]+:", target):
                out.append(target)
    return out


@pytest.mark.parametrize("doc", [str(d.relative_to(ROOT)) for d in DOCS])
def test_every_relative_link_leads_somewhere(doc: str) -> None:
    source = ROOT / doc
    broken = []
    for target in links(source):
        path, _, anchor = target.partition("#")
        where = (source.parent / path).resolve() if path else source
        if not where.exists():
            if str(where.relative_to(ROOT)) not in PENDING:
                broken.append(f"{target}: no such file")
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            broken.append(f"{target}: no heading with that anchor in {where.relative_to(ROOT)}")
    assert not broken, "\n".join(broken)


def test_the_configuration_page_names_every_app_config_key() -> None:
    """docs/configuration.md is the run-config reference: every key of pyproject's ``[tool.flwr.app.config]``."""
    import tomllib

    keys = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    page = (ROOT / "docs" / "configuration.md").read_text()
    missing = sorted(key for key in keys if f"`{key}`" not in page)
    assert not missing, f"docs/configuration.md does not name {missing}"


def test_pending_pages_do_not_exist_yet() -> None:
    arrived = [page for page in PENDING if (ROOT / page).exists()]
    assert not arrived, f"{arrived} exist now: remove them from PENDING so their links are checked"


def test_the_check_sees_a_broken_link(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# Top `x` (y)\n## Top `x` (y)\n[ok](a.md#top-x-y-1) [no](b.md) [n](a.md#nope)\n")
    assert anchors(tmp_path / "a.md") == {"top-x-y", "top-x-y-1"}
    assert links(tmp_path / "a.md") == ["a.md#top-x-y-1", "b.md", "a.md#nope"]
