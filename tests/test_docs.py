"""The manual (`docs/`) documents every worker setting, under the environment name and flag users type, and every
request bound; the README is its front page, and no link in either points nowhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from worker.config import Settings

ROOT = Path(__file__).parent.parent
DOCS = ROOT / "docs"
README = (ROOT / "README.md").read_text()
SETTINGS_PAGE = (DOCS / "workers.md").read_text()  # the worker settings table
CLIENT_PAGE = (DOCS / "client.md").read_text()  # the table of request fields and their bounds


def test_every_setting_is_in_the_manual() -> None:
    missing = [
        name
        for name in Settings.model_fields
        if f"`LLMQ_{name.upper()}`" not in SETTINGS_PAGE or f"`--{name.replace('_', '-')}`" not in SETTINGS_PAGE
    ]
    assert not missing, f"settings missing from docs/workers.md: {missing}"


def test_readme_opens_with_the_two_commands() -> None:
    assert "make run" in README.split("##")[0] and "make test" in README.split("##")[0]


def test_every_request_bound_is_in_the_manual() -> None:
    """The client page's table of request fields states the same maxima as `client.protocol.BOUNDS`."""
    from client.protocol import BOUNDS

    rows = [line.strip() for line in CLIENT_PAGE.splitlines() if line.strip().startswith("| `")]
    for bound in BOUNDS:
        name = bound.field.removeprefix("params.")
        row = next((r for r in rows if f"`{name}`" in r.split("|")[1]), None)
        assert row is not None, f"no docs/client.md row for {bound.field}"
        if isinstance(bound.maximum, int) and bound.maximum < 2**62:
            assert str(bound.maximum) in row, f"{bound.field}: docs/client.md row does not say {bound.maximum}"


def _slug(heading: str) -> str:
    """A heading's anchor as both mkdocs (Python-Markdown's toc) and GitHub make it, for the headings we write."""
    text = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


def _local_links(page: Path) -> list[tuple[Path, str]]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    links = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # https://..., mailto:
        path, _, anchor = target.partition("#")
        links.append(((page.parent / path).resolve() if path else page, anchor))
    return links


@pytest.mark.parametrize("page", [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))], ids=lambda p: p.name)
def test_links_point_somewhere(page: Path) -> None:
    """Every relative link leads to a file, and every anchor to a heading of it (`mkdocs build --strict` checks the
    same inside docs/; this covers the README too, where GitHub readers follow them)."""
    broken = [
        f"{target.relative_to(ROOT)}#{anchor}"
        for target, anchor in _local_links(page)
        if not target.exists() or (anchor and target.suffix == ".md" and anchor not in _anchors(target))
    ]
    assert not broken, f"{page.relative_to(ROOT)} links nowhere: {broken}"


def test_every_page_is_in_the_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    missing = [p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md") if p.relative_to(DOCS).as_posix() not in nav]
    assert not missing, f"docs pages missing from mkdocs.yml's nav: {missing}"
