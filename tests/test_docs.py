"""Docs that resolve: every design citation in ``coordexp/`` names a heading of ``docs/design.md``, and the README's
layout section describes the runtime subpackages that exist, so neither can silently go stale."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
PACKAGE = ROOT / "coordexp"
SOURCES = sorted(PACKAGE.rglob("*.py"))

ANCHOR_LINK = re.compile(r"docs/design\.md#([A-Za-z0-9_-]+)")
SECTION_CITE = re.compile(r"docs/design\.md, ([A-Za-z0-9_ -]*[A-Za-z0-9_])")
DECISION_CITE = re.compile(r"\bdecision (\d+)\b", re.IGNORECASE)
STALE_CITE = re.compile(r"\bspec \d{3}\b|\bspec decision\b|\(spec\b", re.IGNORECASE)


def github_slug(heading: str) -> str:
    """GitHub's heading anchor: lower case, punctuation other than ``-`` and ``_`` dropped, spaces to ``-``."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def design_anchors() -> list[str]:
    """The anchors of every heading in docs/design.md (fenced code skipped), in order."""
    anchors, in_fence = [], False
    for line in DESIGN.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
        elif not in_fence and (match := re.match(r"#{1,6} (.+)$", line)):
            anchors.append(github_slug(match.group(1)))
    return anchors


def cites(pattern: re.Pattern[str]) -> list[tuple[str, str]]:
    """``(file:line, captured text)`` for every match of ``pattern`` in the package sources."""
    found = []
    for path in SOURCES:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            found.extend((f"{path.relative_to(ROOT)}:{number}", m.group(1)) for m in pattern.finditer(line))
    return found


def section_resolves(phrase: str, anchors: list[str]) -> bool:
    """``docs/design.md, <phrase>`` names a heading: the phrase is the heading, or its leading words
    (``decision 8`` for ``Decision 8: packing``)."""
    slug = github_slug(phrase)
    if re.fullmatch(r"decision-\d+", slug):
        return any(anchor.startswith(slug + "-") for anchor in anchors)
    return slug in anchors


def test_slug_matches_github_on_known_headings():
    assert github_slug("Decision 8: packing") == "decision-8-packing"
    assert github_slug("decode_batch_size feasibility rule") == "decode_batch_size-feasibility-rule"
    assert github_slug("Prefix, append, EOS") == "prefix-append-eos"
    assert github_slug("MS310") == "ms310"


@given(st.text(alphabet="abcXYZ019 _-:,.()`", max_size=30))
def test_slug_has_only_anchor_characters(heading):
    assert re.fullmatch(r"[a-z0-9_-]*", github_slug(heading))


def test_design_headings_are_unique_and_decisions_complete():
    anchors = design_anchors()
    assert len(anchors) == len(set(anchors)), "duplicate headings get GitHub suffixes (-1) and break citations"
    decisions = [a for a in anchors if re.match(r"decision-\d+-", a)]
    numbers = [int(a.split("-")[1]) for a in decisions]
    assert numbers == list(range(1, len(numbers) + 1)) and len(numbers) >= 10  # numbered in order, none lost
    assert f"[Decisions](#decisions) (1 to {len(numbers)})" in DESIGN.read_text(encoding="utf-8")  # contents line


def test_design_internal_links_resolve():
    anchors = set(design_anchors())
    links = re.findall(r"\]\(#([^)]+)\)", DESIGN.read_text(encoding="utf-8"))
    assert links, "design.md cross-links its sections"
    assert sorted(set(links) - anchors) == []


def test_anchor_links_in_code_resolve():
    anchors = set(design_anchors())
    broken = [(where, anchor) for where, anchor in cites(ANCHOR_LINK) if anchor not in anchors]
    assert broken == []


def test_section_citations_in_code_resolve():
    anchors = design_anchors()
    found = cites(SECTION_CITE)
    assert len(found) >= 10, "the code cites docs/design.md by section"
    assert [(where, phrase) for where, phrase in found if not section_resolves(phrase, anchors)] == []


def test_decision_numbers_in_code_resolve():
    anchors = design_anchors()
    found = cites(DECISION_CITE)
    assert found, "the code cites decisions"
    assert [(w, n) for w, n in found if not any(a.startswith(f"decision-{n}-") for a in anchors)] == []


def test_modules_citing_decisions_or_ms310_point_at_design_doc():
    """A reader of a module that says "decision 9" or "MS310" finds where that is defined in the module itself."""
    missing = []
    for path in SOURCES:
        text = path.read_text(encoding="utf-8")
        if (DECISION_CITE.search(text) or "MS310" in text) and "docs/design.md" not in text:
            missing.append(str(path.relative_to(ROOT)))
    assert missing == []
    assert "ms310" in design_anchors()


def test_no_citation_of_documents_outside_the_repository():
    assert [f"{where}: {text}" for where, text in cites(re.compile(f"({STALE_CITE.pattern})", re.I))] == []


@pytest.mark.parametrize("phrase, ok", [("decision 8", True), ("server mode", True), ("decision 10", True),
                                        ("decision 99", False),
                                        ("server", False), ("matching", True), ("decision 8 packing", True),
                                        ("decision 1", True), ("decision", False)])
def test_section_resolution_rule(phrase, ok):
    assert section_resolves(phrase, design_anchors()) is ok


def _readme_layout() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index("\n## Layout\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end == -1 else text[start:end]


def test_readme_layout_names_every_runtime_subpackage_and_the_rule():
    layout = _readme_layout()
    subpackages = sorted(p.parent.name for p in (PACKAGE / "runtime").glob("*/__init__.py"))
    assert {"core", "model", "rollout", "server", "train", "toy"} <= set(subpackages)
    assert [name for name in subpackages if f"`{name}/`" not in layout] == []
    assert "tests/test_architecture.py" in layout
    for marker in ("`slow`", "`vllm`"):
        assert marker in layout


def test_readme_layout_names_only_paths_that_exist():
    """Every ``coordexp/...``, ``tests/...`` or ``docs/...`` path the layout names is in the tree."""
    named = re.findall(r"`((?:coordexp|tests|docs|examples|benchmarks)/[\w/.]*?)`", _readme_layout())
    assert named
    assert [path for path in named if not (ROOT / path).exists()] == []


def test_readme_is_a_manual_of_at_most_250_lines():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    headings = re.findall(r"(?m)^## (.+)$", text)
    assert headings[:3] == ["Set-up: two commands on a fresh machine", "Quickstart: your own data, stage 1, stage 2",
                            "Launch recipes"]
    for needed in ("When something fails", "Commands", "Layout"):
        assert needed in headings
    for command in ("bash scripts/demo.sh", "bash scripts/test.sh"):  # CI runs the second exactly
        assert f"\n{command} " in text


def test_readme_and_docs_links_resolve_and_the_picture_is_small():
    """Relative links of the README and the docs it links name files that exist (anchors into design.md too)."""
    anchors = set(design_anchors())
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target, anchor in re.findall(r"\]\(([^)#\s]+)(?:#([^)\s]+))?\)", page.read_text(encoding="utf-8")):
            if target.startswith("http"):
                continue
            path = (page.parent / target).resolve()
            if not path.exists() or (path == DESIGN.resolve() and anchor and anchor not in anchors):
                broken.append(f"{page.name}: {target}#{anchor}")
    assert broken == []
    picture = ROOT / "docs" / "img" / "rollout.png"
    assert picture.stat().st_size < 100_000
