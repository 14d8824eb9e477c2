"""The analyzer's metrics and index files, and the curriculum sampler: only admitted samples
are drawn, every admitted sample once per pass, and a resumed sampler continues the same
stream exactly (DeepSpeed #8405 replays it from the seed)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from zcore.data_efficiency import (
    CurriculumSampler,
    DataEfficiencyConfig,
    MetricIndex,
    analyze,
    seqlen,
    vocab_rarity,
)


def test_vocab_rarity_is_mean_negative_log_unigram_frequency() -> None:
    samples = torch.tensor([[0, 0, 1], [2, 2, 2], [0, 1, 2]])
    counts = {0: 3, 1: 2, 2: 4}  # over the 9 tokens, vocabulary 4 (token 3 unseen)
    p = {t: (counts.get(t, 0) + 1) / (9 + 4) for t in range(4)}
    want = [sum(-math.log(p[t]) for t in row) / 3 for row in samples.tolist()]
    torch.testing.assert_close(vocab_rarity(samples, 4), torch.tensor(want, dtype=torch.float64))
    assert seqlen(torch.tensor([[5, 1, 0, 0], [5, 1, 2, 0]]), pad_id=0).tolist() == [2, 3]


def test_index_files_sort_by_metric(tmp_path: Path) -> None:
    values = torch.tensor([3.0, 1.0, 2.0, 1.0])
    paths = analyze(torch.zeros(4, 2), {"m": lambda s: values}, tmp_path)["m"]
    index = MetricIndex.load(str(paths[0]), str(paths[1]), 4, "x")
    assert index.index_to_sample.tolist() == [1, 3, 2, 0]  # ties keep id order
    assert sorted(index.eligible(1.0, "value", 3.0).tolist()) == [1, 3]
    assert index.eligible(2, "percentile", 4).tolist() == [1, 3]  # (4 // 4) * 2 samples
    # DeepSpeed's counting, (N // max) * d: under max, 4 samples make 0 per percent
    assert index.eligible(99, "percentile", 100).tolist() == []
    assert index.eligible(100, "percentile", 100).tolist() == [1, 3, 2, 0]
    with pytest.raises(
        ValueError, match=r"x.index_to_sample_path .* holds 4 sample ids; the data set has 5"
    ):
        MetricIndex.load(str(paths[0]), None, 5, "x")


def _config(
    path_prefix: Path,
    difficulty_type: str,
    lo: float,
    hi: float,
    total: int,
    step: int = 1,
    num_epochs: int = 1000,
) -> DataEfficiencyConfig:
    metric: dict[str, Any] = {
        "index_to_sample_path": str(path_prefix / "m_index_to_sample.pt"),
        "index_to_metric_path": str(path_prefix / "m_index_to_metric.pt"),
        "difficulty_type": difficulty_type,
        "min_difficulty": lo,
        "max_difficulty": hi,
        "schedule_type": "fixed_linear",
        "schedule_config": {"total_curriculum_step": total, "difficulty_step": step},
    }
    return DataEfficiencyConfig.model_validate(
        {
            "enabled": True,
            "seed": 7,
            "data_sampling": {
                "enabled": True,
                "num_epochs": num_epochs,
                "curriculum_learning": {"enabled": True, "curriculum_metrics": {"m": metric}},
            },
        }
    )


N, B = 200, 16


@pytest.fixture
def metric(tmp_path: Path) -> torch.Tensor:
    values = torch.randint(0, 100, (N,), generator=torch.Generator().manual_seed(0))
    analyze(torch.zeros(N, 1), {"m": lambda s: values}, tmp_path)
    return values


def test_only_admitted_samples_are_drawn(tmp_path: Path, metric: torch.Tensor) -> None:
    sampler = CurriculumSampler(_config(tmp_path, "value", 10, 100, total=30, step=10), N, B)
    for step in range(1, 41):
        batch = sampler.next_batch()
        d = min(100, math.floor(step / 30 * 90 + 10) // 10 * 10)  # the fixed_linear formula
        assert sampler.difficulties == {"m": d}
        assert len(batch) == B and metric[batch].max() <= d, (step, d)
    assert sampler.difficulties == {"m": 100}


def test_percentile_draws_the_easiest_share(tmp_path: Path, metric: torch.Tensor) -> None:
    sampler = CurriculumSampler(_config(tmp_path, "percentile", 25, 100, total=1000), N, B)
    easiest = set(torch.sort(metric, stable=True).indices[: (N // 100) * 25].tolist())
    for _ in range(5):
        assert set(sampler.next_batch().tolist()) <= easiest


def test_every_admitted_sample_once_per_pass(tmp_path: Path, metric: torch.Tensor) -> None:
    sampler = CurriculumSampler(_config(tmp_path, "value", 100, 100, total=1), N, 20)
    drawn = torch.cat([sampler.next_batch() for _ in range(N // 20)])
    assert sorted(drawn.tolist()) == list(range(N))


def test_resume_continues_the_same_stream(tmp_path: Path, metric: torch.Tensor) -> None:
    config = _config(tmp_path, "value", 10, 100, total=25, step=5)
    straight = CurriculumSampler(config, N, B)
    batches = [straight.next_batch() for _ in range(40)]
    first = CurriculumSampler(config, N, B)
    for _ in range(20):
        first.next_batch()
    torch.save(first.state_dict(), tmp_path / "state.pt")
    resumed = CurriculumSampler(config, N, B)
    resumed.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=False))
    for step in range(20, 40):
        assert torch.equal(resumed.next_batch(), batches[step])
    # what DeepSpeed's checkpoint amounts to (#8405): a fresh generator replays the stream
    fresh = CurriculumSampler(config, N, B)
    fresh.load_state_dict(
        {**first.state_dict(), "rng_state": torch.Generator().manual_seed(7).get_state()}
    )
    assert not all(torch.equal(fresh.next_batch(), b) for b in batches[20:25])


def test_resume_refuses_another_seed(tmp_path: Path, metric: torch.Tensor) -> None:
    a = CurriculumSampler(_config(tmp_path, "value", 10, 100, total=25), N, B)
    a.next_batch()
    other = _config(tmp_path, "value", 10, 100, total=25).model_copy(update={"seed": 8})
    with pytest.raises(ValueError, match="seed 7, this run 8"):
        CurriculumSampler(other, N, B).load_state_dict(a.state_dict())


def test_clear_errors(tmp_path: Path, metric: torch.Tensor) -> None:
    empty = CurriculumSampler(_config(tmp_path, "value", -5, 100, total=1000), N, B)
    with pytest.raises(ValueError, match="no sample is admitted at step 1"):
        empty.next_batch()
    short = CurriculumSampler(_config(tmp_path, "value", 100, 100, total=1, num_epochs=1), N, 100)
    short.next_batch(), short.next_batch()
    with pytest.raises(ValueError, match="raise num_epochs"):
        short.next_batch()
