"""docs/simulator.md (the guide) and docs/simulator-reference.md (the reference) in step with each other and with
the code (issue 65 item 5): the guide fits on a page and reaches every section of the reference, every link to
either page lands on a heading, and every file, command, option and source they name exists."""
from __future__ import annotations

import itertools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GUIDE, REFERENCE = ROOT / "docs" / "simulator.md", ROOT / "docs" / "simulator-reference.md"
PAGES = (GUIDE, REFERENCE)
GUIDE_LINES = 150
CODE_PATH = re.compile(r"`((?:engine|tuning|workbench|profilers|bench|tools|tests|docs|examples)/[\w./-]+"
                       r"\.(?:py|yaml|md|json))")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a page's headings (outside code blocks)."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


def sections(text: str) -> list[str]:
    """The `## ` headings of a page."""
    return re.findall(r"^## (.+)$", re.sub(r"```.*?```", "", text, flags=re.S), flags=re.M)


def links_to(text: str, page: str) -> set[str]:
    """The anchors of every link to `page` (a markdown link or a bare `page#anchor`)."""
    return set(re.findall(rf"(?<![\w-]){re.escape(page)}#([\w-]+)", text))


def test_the_guide_fits_on_a_page_and_reaches_every_section_of_the_reference():
    guide = GUIDE.read_text()
    assert len(guide.splitlines()) <= GUIDE_LINES, f"the guide is {len(guide.splitlines())} lines"
    reference = REFERENCE.read_text()
    assert len(sections(reference)) >= 10  # the reference is behind the guide, not in it
    missing = [s for s in sections(reference) if slug(s) not in links_to(guide, "simulator-reference.md")]
    assert missing == [], "sections of the reference the guide does not link"


def test_the_section_check_fails_for_a_section_the_guide_does_not_link():
    planted = REFERENCE.read_text() + "\n## A new section\n\ntext\n"
    assert [s for s in sections(planted) if slug(s) not in links_to(GUIDE.read_text(), "simulator-reference.md")] \
        == ["A new section"]
    assert slug("Mixture-of-Experts (issue 18, `tuning/sim/moe.py`)") == "mixture-of-experts-issue-18-tuningsimmoepy"


def test_every_link_to_the_simulator_pages_lands_on_a_heading():
    """In the docs, the README and the code's docstrings: old links to docs/simulator.md#SECTION of a section that
    moved to the reference would land nowhere."""
    targets = {page.name: anchors(page.read_text()) for page in PAGES}
    texts = [*(ROOT / "docs").glob("*.md"), ROOT / "README.md", *(ROOT / "tuning").rglob("*.py"),
             *(ROOT / "workbench").rglob("*.py")]
    broken = [f"{path.relative_to(ROOT)}: {name}#{anchor}" for path in texts for name, found in targets.items()
              for anchor in links_to(path.read_text(), name) if anchor not in found]
    assert broken == []


def test_every_file_the_simulator_pages_name_exists():
    named = {p for page in PAGES for p in CODE_PATH.findall(page.read_text())}
    assert len(named) >= 20 and sorted(p for p in named if not (ROOT / p).exists()) == []


def test_every_command_and_option_the_simulator_pages_name_exists():
    from test_docs_sync import cli_commands

    commands = cli_commands()
    unknown = set()
    for page in PAGES:
        for command, rest in re.findall(r"workbench ([a-z]+)((?: [^`\n]*)?)", page.read_text()):
            if command not in commands:
                unknown.add(f"{page.name}: workbench {command}")
                continue
            for option in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", rest):
                if not any(option in forms.split("/") for forms in commands[command]):
                    unknown.add(f"{page.name}: workbench {command} {option}")
    assert sorted(unknown) == []


def test_the_guides_per_source_table_names_the_published_sources():
    """The guide's table (`simulate --validate`'s leave-one-source-out figures) names only sources of
    tuning/data/published.yaml, each with the row count the file has for it."""
    from tuning.sim.published import calibration_rows, held_out_rows, sources

    counts: dict[str, int] = {}
    for row in calibration_rows() + held_out_rows():
        counts[row.source] = counts.get(row.source, 0) + 1
    lines = GUIDE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| source |"))
    header = [cell.strip() for cell in lines[start].strip("|").split("|")]
    body = itertools.takewhile(lambda line: line.startswith("|"), lines[start + 2:])  # the table's rows
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in body]
    table = {m.group(1): int(row[header.index("rows")]) for row in cells
             if (m := re.match(r"([a-z0-9-]+)(?: \(.*\))?$", row[0]))}
    assert len(table) >= 10 and set(table) <= set(sources())
    assert {name: counts.get(name) for name in table} == table
