"""The split line and the formatter markers (STYLE.md 1 and 17): every source file stays
under `MAX_LINES` as `ruff format` writes it with every formatter skip marker removed, and the
tree holds fewer than `MAX_FORMAT_MARKERS` markers, each saying why."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Each package's manifest: a scan that finds fewer files than this found almost nothing.
PACKAGES = sorted((ROOT / "packages").glob("*/pyproject.toml"))

# Where a source file is split by concept (STYLE.md: one concept per file, 150-400 lines);
# tests are exempt. A Python file is measured as a reader sees it: `ruff format`'s output of
# the file with every formatter skip marker removed (STYLE.md 17); a Rust file by its lines.
# Each entry: a folder under ROOT and a glob within it.
MAX_LINES = 500
SIZED_SOURCES = [
    ("packages", "*/src/**/*.py"),
    ("src", "**/*.py"),
    ("benchmarks", "**/*.py"),
    ("tools", "*.py"),
    ("native/python", "**/*.py"),
    ("native/crates", "**/*.rs"),
]

# A formatter marker comment (skip, off, on), written so that this file holds none.
_MARKER = re.compile(r"#\s*fmt:\s*(skip|off|on)\b")
SKIP = "# fmt" + ": skip"
# The tree holds fewer than this many markers, each kept for a table that needs its alignment
# and saying so: after the marker on its line (`<marker> # aligned table`) or in a comment on
# the line above.
MAX_FORMAT_MARKERS = 20
# Not the project's source: virtualenvs, build and run outputs.
_NOT_SOURCE = {".venv", "target", "dist", "build", "runs", "node_modules", "__pycache__"}


def _ruff() -> str:
    """The ruff executable of this environment."""
    try:
        from ruff.__main__ import find_ruff_bin

        return str(find_ruff_bin())
    except (ImportError, FileNotFoundError):
        found = shutil.which("ruff")
        assert found, "ruff is not installed: `uv sync` installs the dev group"
        return found


def _without_markers(text: str) -> str:
    """The text with each formatter marker comment, and what follows it on its line, removed."""
    return "\n".join(
        line[: m.start()].rstrip() if (m := _MARKER.search(line)) else line
        for line in text.splitlines()
    )


def _formatted_lines(paths: list[Path]) -> dict[Path, int]:
    """Each Python file's line count after `ruff format` (the project's settings) of its text
    with every formatter marker removed. One ruff run over a copy of all of them."""
    counts: dict[Path, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        copies = {}
        for i, path in enumerate(paths):
            copy = Path(tmp) / f"f{i}.py"
            copy.write_text(_without_markers(path.read_text()) + "\n")
            copies[path] = copy
        if copies:
            subprocess.run(
                [_ruff(), "format", "--quiet", "--config", str(ROOT / "pyproject.toml"), tmp],
                check=True,
                capture_output=True,
                text=True,
            )
        for path, copy in copies.items():
            counts[path] = len(copy.read_text().splitlines())
    return counts


def _over_the_line(paths: list[Path]) -> list[tuple[Path, int]]:
    """(path, line count) for each file longer than MAX_LINES: Python files as formatted
    without markers, other files (Rust) by their lines."""
    python = [path for path in paths if path.suffix == ".py"]
    counts = _formatted_lines(python)
    counts |= {p: len(p.read_text().splitlines()) for p in paths if p.suffix != ".py"}
    return [(path, counts[path]) for path in paths if counts[path] > MAX_LINES]


def _python_files() -> list[Path]:
    """Every Python file of the tree (sources, tests, benchmarks, tools), outputs aside."""
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if d not in _NOT_SOURCE and not d.startswith("."))
        found += [Path(folder) / f for f in sorted(files) if f.endswith((".py", ".pyi"))]
    return found


def _markers(path: Path) -> list[tuple[int, bool]]:
    """(line, has a reason) for each formatter marker comment in a Python file."""
    lines = path.read_text().splitlines()
    found = []
    with path.open("rb") as f:
        for token in tokenize.tokenize(f.readline):
            if token.type != tokenize.COMMENT or not (m := _MARKER.search(token.string)):
                continue
            row = token.start[0]
            after = token.string[m.end() :].strip()
            above = lines[row - 2].strip() if row >= 2 else ""
            reason = after.startswith("#") and len(after) > 1
            reason |= above.startswith("#") and not _MARKER.search(above)
            found.append((row, reason))
    return found


def test_source_files_stay_under_the_split_line() -> None:
    files = sorted(
        path
        for folder, pattern in SIZED_SOURCES
        for path in (ROOT / folder).glob(pattern)
        if "target" not in path.relative_to(ROOT).parts  # cargo's generated sources
    )
    assert len(files) > len(PACKAGES), "the size scan found almost no source"
    too_long = [f"{path.relative_to(ROOT)}: {n} lines" for path, n in _over_the_line(files)]
    assert not too_long, (
        f"past the {MAX_LINES}-line split line; split each by concept into files of "
        "150-400 lines (STYLE.md):\n" + "\n".join(too_long)
    )


def test_split_line_counts_lines(tmp_path: Path) -> None:
    short, long = tmp_path / "short.py", tmp_path / "long.rs"
    short.write_text("x = 1\n" * MAX_LINES)
    long.write_text("// x\n" * (MAX_LINES + 1))
    assert _over_the_line([short, long]) == [(long, MAX_LINES + 1)]


def test_split_line_counts_what_the_formatter_writes(tmp_path: Path) -> None:
    # Squeezed under the line by markers: 251 lines that ruff writes as 502 once they are gone;
    # loose: 501 lines that ruff writes as 499.
    squeezed, loose = tmp_path / "squeezed.py", tmp_path / "loose.py"
    squeezed.write_text(f"a = 1; b = 2  {SKIP}\n" * 251)
    loose.write_text("x = (\n    1\n)\n" + "y = 2\n" * (MAX_LINES - 2))
    assert _over_the_line([squeezed, loose]) == [(squeezed, 502)]


def test_format_markers_are_few_and_say_why() -> None:
    files = _python_files()
    assert len(files) > len(PACKAGES), "the marker scan found almost no Python"
    markers = [(path, row, reason) for path in files for row, reason in _markers(path)]
    silent = [f"{p.relative_to(ROOT)}:{row}" for p, row, reason in markers if not reason]
    assert not silent, (
        "a formatter marker stays only for a table that needs its alignment, and says so "
        "after it (`<marker> # aligned table`) or in a comment on the line above; otherwise "
        "remove it and run `ruff format` (STYLE.md 17):\n" + "\n".join(silent)
    )
    assert len(markers) < MAX_FORMAT_MARKERS, (
        f"{len(markers)} formatter markers in the tree, the limit is fewer than "
        f"{MAX_FORMAT_MARKERS}: remove markers and run `ruff format` (STYLE.md 17):\n"
        + "\n".join(f"{p.relative_to(ROOT)}:{row}" for p, row, _ in markers)
    )


def test_marker_scan_reads_reasons(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text(
        f"a = 1  {SKIP}\n"
        f"b = 1  {SKIP} # aligned table\n"
        "# the columns line up with the spec's table\n"
        f"c = 1  {SKIP}\n"
        f"s = '{SKIP}'\n"
    )
    assert _markers(src) == [(1, False), (2, True), (4, True)]
