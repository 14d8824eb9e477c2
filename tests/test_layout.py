"""The import table of ARCHITECTURE.md, enforced on manifests and source.

For each package: what its pyproject.toml depends on, and every absolute
`import` in its source (read with `ast`, so nothing is executed), must be in
the package's allowed set; the standard library is always allowed. Also each
package ships `py.typed` and reports its pyproject version as `__version__`
(the 500-line split line is tests/test_line_rule.py's).
An import this table does not allow is a design change: raise it in the issue
note rather than widening the table here.
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
FIRST_PARTY = {
    "znative",
    "zcore",
    "zoffload",
    "zcomm",
    "zquant",
    "zmoe",
    "zserve",
    "zchat",
    "ztrain",
    "zstack",
}
# zserve's HTTP server, the replica router's client (httpx), tokenizer and checkpoint loading
# (ARCHITECTURE.md: OpenAI-compatible server with replicas, Hugging Face-format checkpoints).
SERVE_STACK = {
    "fastapi",
    "starlette",
    "uvicorn",
    "anyio",
    "sse_starlette",
    "httpx",
    "pydantic",
    "tokenizers",
    "transformers",
    "safetensors",
    "jinja2",  # chat templates, rendered in a sandbox as transformers does
    "llguidance",  # constrained decoding: response_format json_object/json_schema, tool calls
}
# Top-level modules each package may import, besides itself and the standard library.
ALLOWED: dict[str, set[str]] = {
    "znative": {"numpy", "cupy"},
    "zcore": {"torch", "pydantic", "znative"},
    "zoffload": {"zcore", "znative", "aiofiles", "torch"},
    "zcomm": {"zcore", "znative", "torch"},
    # safetensors: the serialization format for packed models; transformers and
    # tokenizers (optional extra `hf`, imported lazily) load the real HF models it is measured on.
    "zquant": {"torch", "znative", "safetensors", "transformers", "tokenizers"},
    "zmoe": {"zcore", "torch"},
    "zserve": {"torch", "znative", "zquant", *SERVE_STACK},
    # RLHF on Hugging Face chat models (transformers builds them, tokenizers/jinja2 apply the
    # chat template) over zcore's ZeRO-3 and zserve's runner; zquant optional.
    "zchat": {
        "zcore",
        "zserve",
        "zquant",
        "torch",
        "transformers",
        "tokenizers",
        "safetensors",
        "jinja2",
    },
    # The `z train` recipe: zcore's engine, zmoe's layer for `--moe` (zcomm, zoffload and zquant
    # plug in through config), numpy for the token windows, the tokenizer, loss plot, progress
    # display and safetensors export.
    "ztrain": {
        "zcore",
        "zmoe",
        "zcomm",
        "zoffload",
        "zquant",
        "torch",
        "numpy",
        "tokenizers",
        "matplotlib",
        "rich",
        "safetensors",
    },
}
# The `z` CLI: the PNG of a `z chat` stage (matplotlib) and `z checkpoint consolidate`'s
# safetensors file besides what the libraries use.
ALLOWED["zstack"] = set().union(*ALLOWED.values()) | FIRST_PARTY | {"typer", "pynvml"}
# Optional extras that only back a torch submodule (never imported by name).
# zcore's optional extra `hf`: transformers, for zcore.hf.Trainer (below).
# ztrain's optional extra `hf`: transformers and peft, for `z finetune` (below).
EXTRAS_ALLOWED: dict[str, set[str]] = {
    "zcore": {"tensorboard", "transformers"},
    "ztrain": {"transformers", "peft"},
}
# Single modules allowed an import their package is not (path from the repo root). zcore.hf.Trainer
# is a transformers.Trainer subclass (issue 47: a DeepSpeed user's Trainer script moves over by
# one line), so that one module imports transformers; `zcore.hf` loads it only when
# `zcore.hf.Trainer` is used (tests/zcore/hf/test_trainer_config.py checks), and every other
# zcore module still may not.
# `z finetune` (issue 47) runs a user's Hugging Face model through zcore.hf.Trainer: its run
# (`ztrain/finetune.py`: the model, LoRA and merge) and its Trainer callback (`finetune_log.py`)
# import transformers/peft; the plan and data checks (`finetune_plan.py`, `finetune_data.py`)
# and the rest of ztrain do not.
# zcore.hf.Trainer at tensor parallelism (issue 44, `trainer_tp.py`) shards its data loaders
# over the data ranks with accelerate's `prepare_data_loader`, the function transformers'
# Trainer already runs them through (accelerate comes with the `hf` extra's transformers[torch]).
FILE_ALLOWED: dict[str, set[str]] = {
    "packages/zcore/src/zcore/hf/trainer.py": {"transformers"},
    "packages/zcore/src/zcore/hf/trainer_tp.py": {"accelerate"},
    "packages/ztrain/src/ztrain/finetune.py": {"transformers", "peft"},
    "packages/ztrain/src/ztrain/finetune_log.py": {"transformers"},
}


@dataclass(frozen=True)
class Package:
    name: str
    manifest: Path  # its pyproject.toml
    source: Path  # the import package folder, e.g. packages/zcore/src/zcore


def _packages() -> list[Package]:
    found = [
        Package("zstack", ROOT / "pyproject.toml", ROOT / "src" / "zstack"),
        Package(
            "znative", ROOT / "native" / "pyproject.toml", ROOT / "native" / "python" / "znative"
        ),
    ]
    for directory in sorted((ROOT / "packages").iterdir()):
        if (directory / "pyproject.toml").is_file():
            found.append(
                Package(
                    directory.name, directory / "pyproject.toml", directory / "src" / directory.name
                )
            )
    return found


PACKAGES = _packages()


def _project(package: Package) -> dict:
    return tomllib.loads(package.manifest.read_text())["project"]


def _module_of_distribution(requirement: str) -> str:
    """The top-level module a requirement provides, e.g. `cupy-cuda12x>=13` -> `cupy`."""
    name = re.split(r"[\s<>=!~;\[(@]", requirement.strip(), maxsplit=1)[0].lower()
    if re.fullmatch(r"cupy(-cuda\d+x)?", name):
        return "cupy"
    return {"nvidia-ml-py": "pynvml", "sse-starlette": "sse_starlette"}.get(
        name, name.replace("-", "_")
    )


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, top-level module) for each absolute import in a file; relative ones stay inside."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def test_every_package_is_in_the_table() -> None:
    assert {p.name for p in PACKAGES} == set(ALLOWED)


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_manifest_dependencies_are_allowed(package: Package) -> None:
    project = _project(package)
    assert project["name"] == package.name
    requirements = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        requirements += extra
    not_allowed = {
        req
        for req in requirements
        if (module := _module_of_distribution(req)) != package.name
        and module not in ALLOWED[package.name] | EXTRAS_ALLOWED.get(package.name, set())
    }
    assert not not_allowed, (
        f"{package.manifest.relative_to(ROOT)} depends on {sorted(not_allowed)}; "
        f"{package.name} may use only {sorted(ALLOWED[package.name])} (ARCHITECTURE.md)"
    )


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_source_imports_are_allowed(package: Package) -> None:
    files = sorted([*package.source.rglob("*.py"), *package.source.rglob("*.pyi")])
    assert files, f"no source under {package.source}"
    allowed = ALLOWED[package.name] | {package.name} | set(sys.stdlib_module_names)
    violations = [
        f"{path.relative_to(ROOT)}:{line}: import {module}"
        for path in files
        for line, module in _imports(path)
        if module not in allowed | FILE_ALLOWED.get(path.relative_to(ROOT).as_posix(), set())
    ]
    assert not violations, (
        f"{package.name} may import only {sorted(ALLOWED[package.name])} and the standard "
        "library (ARCHITECTURE.md):\n" + "\n".join(violations)
    )


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_py_typed_and_version(package: Package) -> None:
    assert (package.source / "py.typed").is_file(), f"{package.source.relative_to(ROOT)}/py.typed"
    module = importlib.import_module(package.name)
    # znative is installed as a built wheel; the others must be this checkout (editable),
    # not a same-named project from the registry.
    if package.name != "znative":
        assert Path(module.__file__).resolve().parent == package.source.resolve()
    assert module.__version__ == _project(package)["version"], package.name


def test_import_scan_sees_every_form(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "import os.path, numpy as np\n"
        "from torch.nn import functional\n"
        "from . import sibling\n"
        "def f():\n"
        "    import zcore.optim\n"
    )
    assert _imports(source) == [(1, "os"), (1, "numpy"), (2, "torch"), (5, "zcore")]


# -- the seams: other packages use zcore's public interface only ---------------------------
ZCORE = ROOT / "packages" / "zcore" / "src" / "zcore"
# Outside zcore's own package; benchmarks are users too.
OUTSIDE_ZCORE = [p.source for p in PACKAGES if p.name != "zcore"] + [ROOT / "benchmarks"]


def _private_zcore_imports(path: Path) -> list[str]:
    """`line: module` for each import of a `_`-prefixed zcore module (or name from one)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        modules: list[str] = []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for module in modules:
            parts = module.split(".")
            if parts[0] == "zcore" and any(
                p.startswith("_") and not p.startswith("__") for p in parts[1:]
            ):
                found.append(f"{node.lineno}: {module}")
                break
    return found


def _zcore_private_methods() -> dict[str, set[str]]:
    """zcore class name -> its `_`-prefixed (non-dunder) method names."""
    out: dict[str, set[str]] = {}
    for path in ZCORE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef):
                names = {
                    f.name
                    for f in node.body
                    if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
                    and f.name.startswith("_")
                    and not f.name.endswith("__")
                }
                out.setdefault(node.name, set()).update(names)
    return out


def _private_overrides(path: Path, private: dict[str, set[str]]) -> list[str]:
    """`Class.method` for each method of a subclass of a zcore class that overrides one of
    the zcore class's private methods."""
    tree = ast.parse(path.read_text(), filename=str(path))
    from_zcore = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        and node.level == 0
        and (node.module or "").split(".")[0] == "zcore"
        for alias in node.names
    }
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        bases = {b.id for b in node.bases if isinstance(b, ast.Name)} & from_zcore
        hidden = set().union(*(private.get(b, set()) for b in bases)) if bases else set()
        for f in node.body:
            if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef) and f.name in hidden:
                found.append(f"{node.name}.{f.name}")
    return found


def test_no_package_reaches_into_zcore_privates() -> None:
    private = _zcore_private_methods()
    problems = []
    for folder in OUTSIDE_ZCORE:
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(ROOT)
            problems += [
                f"{rel}:{hit} imports a private zcore module"
                for hit in _private_zcore_imports(path)
            ]
            problems += [
                f"{rel}: {hit} overrides a private zcore method"
                for hit in _private_overrides(path, private)
            ]
    assert not problems, (
        "use zcore's public interface (ARCHITECTURE.md, seams); make the name public in zcore "
        "if a plug-in needs it:\n" + "\n".join(problems)
    )


def test_privates_scan_sees_imports_and_overrides(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text(
        "import zcore.optim._base\n"
        "from zcore.optim import _buffers\n"
        "from zcore.zero.optimizer import ZeroOptimizer\n"
        "class Mine(ZeroOptimizer):\n"
        "    def _secret(self): ...\n"
        "    def public(self): ...\n"
    )
    assert _private_zcore_imports(src) == ["1: zcore.optim._base", "2: zcore.optim._buffers"]
    assert _private_overrides(src, {"ZeroOptimizer": {"_secret"}}) == ["Mine._secret"]


# -- the CLI is the top: nothing but its own tests imports it ------------------------------
# `src/zstack` is the `z` Typer CLI (layer 3) and `tests/zstack` tests its commands; every
# package, every other test (helpers in tests/utils included) and every benchmark uses the
# libraries, or runs `z` as a user does (tests/utils/cli.py).
CLI_OWN = [ROOT / "src" / "zstack", ROOT / "tests" / "zstack"]
CLI_SCANNED = [ROOT / "packages", ROOT / "native" / "python", ROOT / "tests", ROOT / "benchmarks"]


def _cli_imports(path: Path) -> list[str]:
    """`line: module` for each import of `zstack`, or of `tests.zstack` (a CLI test's
    helpers), in a file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        for module in modules:
            parts = module.split(".")
            if parts[0] == "zstack" or parts[:2] == ["tests", "zstack"]:
                found.append(f"{node.lineno}: {module}")
                break
    return found


def test_only_the_cli_and_its_tests_import_zstack() -> None:
    files = sorted(
        path
        for folder in CLI_SCANNED
        for path in folder.rglob("*.py")
        if not any(path.is_relative_to(own) for own in CLI_OWN)
        and "target" not in path.relative_to(ROOT).parts
    )
    assert len(files) > 100, "the scan found almost no files"
    problems = [f"{path.relative_to(ROOT)}:{hit}" for path in files for hit in _cli_imports(path)]
    assert not problems, (
        "only src/zstack and tests/zstack may import zstack (ARCHITECTURE.md: the CLI is "
        "layer 3); import the library that does the work, or run `z` in a child process "
        "(tests/utils/cli.py: run_z):\n" + "\n".join(problems)
    )


def test_cli_scan_sees_every_form(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "import zstack.cli\n"
        "from zstack import bench\n"
        "from tests.zstack.tiny import x\n"
        "from tests import zstack\n"
        "import zstackish, ztrain\n"
        "from tests.utils import cli\n"
        "def f():\n"
        "    from zstack.bench import load\n"
    )
    assert _cli_imports(source) == [
        "1: zstack.cli",
        "2: zstack",
        "3: tests.zstack.tiny",
        "4: tests.zstack",
        "8: zstack.bench",
    ]
