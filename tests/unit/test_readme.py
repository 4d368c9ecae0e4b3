"""The README stays a front door whose promises point at real tests: every test its guarantee
table names exists, the README stays short, and every relative link in the README and in
docs/ points at a file that exists. Plain text checks, no Ray."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_README_LINES = 205

# `tests/path.py::test_name`, `tests/path.py::Class::test_name`, either with a `[param]` suffix.
TEST_ID = re.compile(r"(tests/[\w/]+\.py)::((?:\w+::)?)(test_\w+)(?:\[[^\]`]*\])?")
# [text](target) and ![alt](target); the target ends at whitespace or the closing parenthesis.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _guarantee_rows() -> list[str]:
    """The body rows of the table under `## Guarantees`."""
    text = README.read_text()
    section = re.search(r"^## Guarantees\n(.*?)(?=^## )", text, re.S | re.M)
    assert section, "README.md has no '## Guarantees' section"
    rows = [line for line in section.group(1).splitlines() if line.startswith("|")]
    return rows[2:]  # after the header and its --- line


def _markdown_files() -> list[pathlib.Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def test_the_readme_is_a_front_door_of_at_most_205_lines():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move detail to docs/"


def test_every_guarantee_row_names_a_test_that_exists():
    rows = _guarantee_rows()
    assert len(rows) >= 10, "the guarantee table lost its rows"
    missing = []
    for row in rows:
        found = TEST_ID.findall(row)
        assert found, f"guarantee row without a test: {row[:100]}"
        for path, klass, name in found:
            source = ROOT / path
            if not source.is_file():
                missing.append(f"{path} (no such file)")
                continue
            text = source.read_text()
            if not re.search(rf"^\s*(?:async\s+)?def {name}\(", text, re.M):
                missing.append(f"{path}::{klass}{name} (no such test)")
            elif klass and not re.search(rf"^class {klass[:-2]}\b", text, re.M):
                missing.append(f"{path}::{klass}{name} (no such class)")
    assert not missing, "README guarantees name tests that do not exist: " + ", ".join(missing)


def _missing_tests(text: str) -> list[str]:
    """The full test ids (`tests/...py::test_name`) in `text` that name no test."""
    missing = []
    for path, klass, name in TEST_ID.findall(text):
        source = ROOT / path
        if not source.is_file():
            missing.append(f"{path} (no such file)")
        elif not re.search(rf"^\s*(?:async\s+)?def {name}\(", source.read_text(), re.M):
            missing.append(f"{path}::{klass}{name} (no such test)")
    return missing


def test_every_test_the_docs_name_exists():
    missing = {page.name: _missing_tests(page.read_text())
               for page in sorted((ROOT / "docs").glob("*.md"))}
    assert not any(missing.values()), f"docs name tests that do not exist: {missing}"


def test_every_relative_link_in_the_readme_and_docs_points_at_a_file():
    broken = []
    for page in _markdown_files():
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
        for target in LINK.findall(text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # http(s), mailto: and anchors within the same page
            path = target.split("#", 1)[0]
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, "links to files that do not exist: " + ", ".join(broken)


def test_the_link_check_would_catch_a_broken_link_and_a_missing_test():
    """The two checks above can fail."""
    assert LINK.findall("see [x](docs/nowhere.md#a) and ![y](img.png)") == ["docs/nowhere.md#a", "img.png"]
    assert TEST_ID.findall("`tests/unit/test_a.py::Case::test_b[p-1]`") == [
        ("tests/unit/test_a.py", "Case::", "test_b")]
    assert not (ROOT / "docs" / "nowhere.md").exists()
    assert _missing_tests("`tests/unit/test_readme.py::test_nowhere`") == [
        "tests/unit/test_readme.py::test_nowhere (no such test)"]
