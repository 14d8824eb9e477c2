"""ZeRO-Offload to CPU: same losses and weights as without offload, across a checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.utils.distributed import run_ranks
from tests.zoffload.equivalence import assert_matches, offload_vs_plain


@pytest.mark.parametrize("stage", [2, 3])
def test_cpu_offload_matches_plain_training(stage: int, tmp_path: Path) -> None:
    offload = {"device": "cpu", "pin_memory": True}
    results = run_ranks(
        offload_vs_plain, 2, args=(stage, offload, str(tmp_path / "ckpt"), 10), timeout=300
    )
    for got in results:
        assert got["zopt"] == "MemoryStore"
        assert_matches(got)


def test_without_zoffload_the_config_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    from zcore.config import ZConfig, features
    from zcore.config.errors import ConfigError

    monkeypatch.setattr(features, "_registered", set())
    monkeypatch.setattr(features, "_loaded", True)  # as if zoffload were not installed
    with pytest.raises(ConfigError, match="pip install zoffload"):
        ZConfig.load(
            {
                "train_micro_batch_size_per_gpu": 1,
                "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
            }
        )


def test_zcore_finds_zoffload_through_its_entry_point() -> None:
    from importlib.metadata import entry_points

    from zcore.config import features
    from zcore.zero.backends import optimizer_backend

    names = [ep.value for ep in entry_points(group=features.EXTENSIONS_GROUP)]
    assert "zoffload.extension" in names
    assert optimizer_backend("cpu").__module__ == "zoffload.cpu_offload"
