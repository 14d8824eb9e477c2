"""Session-wide real corpus, tokenizer and encoded splits (built once, ~8 s)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ztrain.data import ShakespeareData, load_plays
from ztrain.tokenizer import Tokenizer, train_or_load


@pytest.fixture(scope="session")
def plays() -> list[tuple[str, str]]:
    return load_plays()


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("recipe-cache")


@pytest.fixture(scope="session")
def tokenizer(plays: list[tuple[str, str]], cache_dir: Path) -> Tokenizer:
    return train_or_load(cache_dir, 2048, plays)


@pytest.fixture(scope="session")
def data(tokenizer: Tokenizer, plays: list[tuple[str, str]], cache_dir: Path) -> ShakespeareData:
    return ShakespeareData.load(tokenizer, cache_dir, plays)
