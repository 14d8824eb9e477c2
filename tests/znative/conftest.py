"""`simd`: a test runs once per SIMD level this CPU has, with znative forced to it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import znative
from tests.znative.simd_levels import LEVELS


@pytest.fixture(params=LEVELS)
def simd(request: pytest.FixtureRequest) -> Iterator[str]:
    znative.set_simd_level(request.param)
    try:
        yield request.param
    finally:
        znative.set_simd_level(None)
