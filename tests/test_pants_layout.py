"""pants.toml and every BUILD file agree with the pyproject.toml files.

Pants is not installed on these machines, so nothing else would notice a BUILD
file drifting from its package: this parses both (BUILD files are Python
syntax) and compares them.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = sorted(p for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").is_file())
DIST_DIRS = [ROOT, ROOT / "native", *PACKAGE_DIRS]


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() or "."


def _build_targets(build: Path) -> list[tuple[str, dict[str, Any]]]:
    """Each top-level target call in a BUILD file as (target type, keyword arguments).

    Argument values are evaluated as literals, with nested calls such as
    `python_artifact(...)` turned into `{"__call__": name, **kwargs}`.
    """

    def value(node: ast.expr) -> Any:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            return {"__call__": node.func.id, **{k.arg: value(k.value) for k in node.keywords}}
        if isinstance(node, ast.List):
            return [value(item) for item in node.elts]
        if isinstance(node, ast.Dict):
            if any(k is None for k in node.keys):
                raise AssertionError(f"{build}:{node.lineno}: `**` in a BUILD dict")
            return {value(k): value(v) for k, v in zip(node.keys, node.values, strict=True)}
        return ast.literal_eval(node)

    targets = []
    for statement in ast.parse(build.read_text(), filename=str(build)).body:
        call = statement.value if isinstance(statement, ast.Expr) else None
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
            raise AssertionError(f"{build}:{statement.lineno}: expected only target calls")
        targets.append((call.func.id, {k.arg: value(k.value) for k in call.keywords}))
    return targets


def _root_patterns() -> list[str]:
    return tomllib.loads((ROOT / "pants.toml").read_text())["source"]["root_patterns"]


def _is_source_root(path: str, patterns: list[str]) -> bool:
    """Pants' rule: `/x` matches the directory x under the build root, `x` any dir ending in x."""
    for pattern in patterns:
        if pattern.startswith("/"):
            if pattern.strip("/") == path:
                return True
        elif path == pattern or path.endswith("/" + pattern):
            return True
    return False


@pytest.mark.parametrize(
    "source_root",
    ["src", "native/python", *(f"{_rel(d)}/src" for d in PACKAGE_DIRS)],
)
def test_source_roots_cover_every_package(source_root: str) -> None:
    patterns = _root_patterns()
    assert (ROOT / source_root).is_dir(), source_root
    assert _is_source_root(source_root, patterns), f"{source_root} not in {patterns}"


def test_every_source_root_pattern_exists() -> None:
    for pattern in _root_patterns():
        if pattern.startswith("/"):
            assert (ROOT / pattern.strip("/")).is_dir(), (
                f"pants.toml root {pattern} is not a folder"
            )


@pytest.mark.parametrize("directory", DIST_DIRS, ids=_rel)
def test_build_distribution_matches_pyproject(directory: Path) -> None:
    build = directory / "BUILD"
    assert build.is_file(), f"{_rel(directory)} has a pyproject.toml but no BUILD"
    project = tomllib.loads((directory / "pyproject.toml").read_text())["project"]
    targets = _build_targets(build)

    distributions = [kwargs for kind, kwargs in targets if kind == "python_distribution"]
    assert len(distributions) == 1, f"{build}: expected one python_distribution"
    artifact = distributions[0]["provides"]
    assert artifact["__call__"] == "python_artifact"
    assert (artifact["name"], artifact["version"]) == (project["name"], project["version"]), build

    # Each local dependency names a target defined in this BUILD file.
    names = {kwargs.get("name") for _, kwargs in targets}
    for dep in distributions[0].get("dependencies", []):
        if dep.startswith(":"):
            assert dep[1:] in names, f"{build}: dependency {dep} is not defined there"


@pytest.mark.parametrize("directory", DIST_DIRS, ids=_rel)
def test_build_sources_include_the_package(directory: Path) -> None:
    name = tomllib.loads((directory / "pyproject.toml").read_text())["project"]["name"]
    targets = _build_targets(directory / "BUILD")
    globs = [g for kind, kw in targets if kind == "python_sources" for g in kw.get("sources", [])]
    matched = {path for pattern in globs for path in directory.glob(pattern)}
    init = next(
        init
        for init in (
            directory / "src" / name / "__init__.py",
            directory / "python" / name / "__init__.py",
        )
        if init.is_file()
    )
    assert init in matched, f"{directory / 'BUILD'}: python_sources {globs} miss {init}"
    for pattern in globs:
        assert any(directory.glob(pattern)), f"{directory / 'BUILD'}: {pattern} matches nothing"
