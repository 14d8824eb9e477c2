"""`zserve.pipeline` is the function whatever was imported first: a submodule named like
a lazy export would be bound over it on the package when imported ('module' object is
not callable)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import pytest

import zserve


@pytest.mark.parametrize(
    "first",
    [
        "import zserve.pipelines",
        "from zserve.pipelines import pipeline",
        "from zserve import pipelines",
        "import zserve",
    ],
)
def test_pipeline_attribute_is_the_function_after_any_import(first: str) -> None:
    code = (
        f"{first}\n"
        "import zserve, zserve.pipelines as impl\n"
        "assert callable(zserve.pipeline), zserve.pipeline\n"
        "assert zserve.pipeline is impl.pipeline, zserve.pipeline\n"
        "assert zserve.Pipeline is impl.Pipeline\n"
        "from zserve import pipeline\n"
        "assert pipeline is impl.pipeline\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_no_submodule_shadows_a_lazy_export() -> None:
    submodules = {m.name for m in pkgutil.iter_modules(zserve.__path__)}
    assert not submodules & set(zserve._EXPORTS)
