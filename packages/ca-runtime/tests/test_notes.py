"""The design Notes hold together: every ``[Note: Topic]`` named resolves to one Note, where it says it is.

A Note is defined by a line holding only ``[Note: Topic]`` (after a comment
marker or a docstring's quotes); it is referenced anywhere else, across line
breaks and comment markers. Scanned: the three packages' sources and tests,
``bench/*.py``, and the README files (``bench/LOG.md`` is a dated log and may
name Notes that were renamed since).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SUFFIXES = {".py", ".pyi", ".cpp", ".h"}
_DEFINITION = re.compile(r'^\s*(?:/\*|"""|#\s*|//\s*)?\[Note: ([^\]]+)\]\s*$', re.M)
_COMMENT_MARKER = re.compile(r"^\s*(?:///|//|#:|#|\*)\s?")
_REFERENCE = re.compile(r"\[Note: ([^\]]+)\]")
#: README's pointers: "[Note: Topic] in `file`".
_POINTER = re.compile(r"\[Note: ([^\]]+)\] in `([^`]+)`")


def _files() -> list[Path]:
    sources = [
        p
        for p in (REPO / "packages").rglob("*")
        if p.suffix in SUFFIXES
        and not any(part in {"build", ".venv", "__pycache__"} for part in p.parts)
        and p != Path(__file__).resolve()  # its own patterns name no Note
    ]
    return (
        sources + sorted((REPO / "bench").glob("*.py")) + [REPO / "README.md", REPO / "bench" / "README.md"]
    )


def _flat(text: str) -> str:
    """The text as one line: comment markers dropped, C++ string literals joined."""
    lines = " ".join(_COMMENT_MARKER.sub("", line) for line in text.splitlines())
    return re.sub(r'"\s*"', "", re.sub(r"\s+", " ", lines))


@pytest.fixture(scope="module")
def notes() -> tuple[dict[str, list[Path]], dict[Path, str]]:
    if not (REPO / "README.md").is_file() or not (REPO / "packages" / "ca-core" / "csrc").is_dir():
        pytest.skip(f"not run from a checkout ({REPO} has no README.md or ca-core sources)")
    definitions: dict[str, list[Path]] = {}
    flat: dict[Path, str] = {}
    for path in _files():
        text = path.read_text(encoding="utf-8")
        for match in _DEFINITION.finditer(text):
            definitions.setdefault(match.group(1), []).append(path)
        flat[path] = _flat(text)
    return definitions, flat


def test_every_note_is_defined_once(notes: tuple[dict[str, list[Path]], dict[Path, str]]) -> None:
    definitions, _ = notes
    assert len(definitions) > 50  # the scan finds the house's Notes
    twice = {
        topic: [str(p.relative_to(REPO)) for p in paths]
        for topic, paths in definitions.items()
        if len(paths) > 1
    }
    assert twice == {}


def test_every_note_named_is_defined(notes: tuple[dict[str, list[Path]], dict[Path, str]]) -> None:
    definitions, flat = notes
    dangling = sorted(
        (str(path.relative_to(REPO)), topic)
        for path, text in flat.items()
        for topic in set(_REFERENCE.findall(text))
        if topic not in definitions and topic != "..."
    )
    assert dangling == []


def test_readme_points_at_the_file_of_each_note(notes: tuple[dict[str, list[Path]], dict[Path, str]]) -> None:
    definitions, flat = notes
    wrong = []
    for topic, named in _POINTER.findall(flat[REPO / "README.md"]):
        homes = definitions.get(topic, [])
        if not any(str(home).endswith(named) for home in homes):
            wrong.append((topic, named, [str(h.relative_to(REPO)) for h in homes]))
    assert wrong == []
