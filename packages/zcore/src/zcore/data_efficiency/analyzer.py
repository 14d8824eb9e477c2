"""The data analyzer: per-sample difficulty metrics computed once, saved as index files.

DeepSpeed's ``DataAnalyzer`` maps a data set through metric functions and writes, per
metric, ``<metric>_index_to_sample`` (samples grouped by metric value, easiest first) and
``<metric>_index_to_metric`` (the value of each group) as Megatron mmap files. Here a
metric's index is two flat tensors of the same length N (the number of samples), each saved
with ``torch.save`` (zcore does not depend on numpy):

- ``<metric>_index_to_sample.pt``: every sample id once, in ascending metric order (ties
  by id, a stable sort), int32 (int64 past 2**31 samples);
- ``<metric>_index_to_metric.pt``: the metric of each of those ids, ascending;
- ``<metric>_sample_to_metric.pt``: the metric by sample id (for inspection).

So "the samples with metric <= v" is a prefix found by binary search
(:meth:`MetricIndex.eligible`), and "the easiest p percent" is a prefix too.

Two metrics come built in: ``seqlen`` (tokens other than padding) and ``vocab_rarity``
(the mean of ``-log p(token)`` over the sample's tokens, ``p`` the unigram frequency over
the whole data set: text made of common tokens is easier).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from zcore.checkpoint.files import atomic_write

#: ``(samples (N, T) int tensor) -> metric (N,)``; built from the whole data set.
Metric = Callable[[torch.Tensor], torch.Tensor]


def seqlen(samples: torch.Tensor, pad_id: int | None = None) -> torch.Tensor:
    """Tokens per sample (N,) int64: ``T``, less the ``pad_id`` tokens when given."""
    n, t = samples.shape
    if pad_id is None:
        return torch.full((n,), t, dtype=torch.int64)
    return (samples != pad_id).sum(dim=1).to(torch.int64)


def unigram_log_prob(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``log p(token)`` (vocab_size,) float64 from counts over ``tokens`` (add-one smoothed,
    so a token never seen still has a finite rarity)."""
    counts = torch.bincount(tokens.reshape(-1).to(torch.int64), minlength=vocab_size)
    counts = counts.to(torch.float64)
    return torch.log((counts + 1.0) / (counts.sum() + vocab_size))


def vocab_rarity(
    samples: torch.Tensor, vocab_size: int, corpus: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean ``-log p(token)`` over each sample's tokens (N,) float64; ``p`` from ``corpus``
    (default: the samples themselves)."""
    logp = unigram_log_prob(samples if corpus is None else corpus, vocab_size)
    return -logp[samples.to(torch.int64)].mean(dim=1)


def index_paths(save_dir: str | os.PathLike[str], metric: str) -> tuple[Path, Path]:
    """``(index_to_sample, index_to_metric)`` paths of ``metric`` under ``save_dir``."""
    base = Path(save_dir)
    return base / f"{metric}_index_to_sample.pt", base / f"{metric}_index_to_metric.pt"


def _save(tensor: torch.Tensor, path: Path) -> None:
    atomic_write(path, lambda f: torch.save(tensor.clone(), f))


def save_index(
    values: torch.Tensor,
    sample_path: str | os.PathLike[str],
    metric_path: str | os.PathLike[str],
) -> None:
    """Save the index of per-sample ``values`` (N,) at the two paths (atomically), and the
    values by sample id beside ``sample_path`` as ``*_sample_to_metric.pt``."""
    values = torch.as_tensor(values)
    if values.dim() != 1 or len(values) == 0:
        raise ValueError(f"expected one metric value per sample, got shape {tuple(values.shape)}")
    order = torch.sort(values, stable=True).indices
    order = order.to(torch.int32 if len(values) <= 2**31 else torch.int64)
    sample_path, metric_path = Path(sample_path), Path(metric_path)
    for path in (sample_path, metric_path):
        path.parent.mkdir(parents=True, exist_ok=True)
    _save(order, sample_path)
    _save(values[order.long()], metric_path)
    stem = sample_path.name.removesuffix(sample_path.suffix).removesuffix("_index_to_sample")
    _save(values, sample_path.with_name(f"{stem}_sample_to_metric{sample_path.suffix or '.pt'}"))


def write_index(
    values: torch.Tensor, save_dir: str | os.PathLike[str], metric: str
) -> tuple[Path, Path]:
    """Save the index of per-sample ``values`` (N,) under ``save_dir``; returns the
    ``(index_to_sample, index_to_metric)`` paths for the config."""
    paths = index_paths(save_dir, metric)
    save_index(values, *paths)
    return paths


def analyze(
    samples: torch.Tensor,
    metrics: dict[str, Metric],
    save_dir: str | os.PathLike[str],
) -> dict[str, tuple[Path, Path]]:
    """Compute each metric of ``samples`` (N, T) once and write its index files; returns
    ``{metric: (index_to_sample_path, index_to_metric_path)}``."""
    out = {}
    for name, fn in metrics.items():
        values = torch.as_tensor(fn(samples))
        if tuple(values.shape) != (len(samples),):
            raise ValueError(
                f"metric {name!r} returned shape {tuple(values.shape)} for {len(samples)} samples; "
                "it must return one value per sample"
            )
        out[name] = write_index(values, save_dir, name)
    return out


@dataclass(frozen=True)
class MetricIndex:
    """One metric's index: sample ids in ascending metric order, and their metrics."""

    index_to_sample: torch.Tensor
    """(N,) int64, every sample id once, easiest first."""
    index_to_metric: torch.Tensor | None
    """(N,) ascending metrics of those ids; None when only percentiles are used."""

    @classmethod
    def load(
        cls, sample_path: str, metric_path: str | None, num_samples: int, where: str
    ) -> MetricIndex:
        """Read and check the index files of the metric at config path ``where`` for a
        data set of ``num_samples`` samples (ValueError naming the key and the fix)."""
        fix = (
            "delete the file to have z train analyze again, or rerun zcore.data_efficiency.analyze"
        )
        ids = _load(sample_path, f"{where}.index_to_sample_path").to(torch.int64)
        if ids.dim() != 1 or len(ids) != num_samples:
            raise ValueError(
                f"{where}.index_to_sample_path `{sample_path}` holds {len(ids)} sample ids; the "
                f"data set has {num_samples} samples (was it analyzed for another data set or "
                f"sequence length?); {fix}"
            )
        if len(torch.unique(ids)) != num_samples or int(ids.max()) >= num_samples:
            raise ValueError(
                f"{where}.index_to_sample_path `{sample_path}` is not a permutation of the "
                f"{num_samples} sample ids; {fix}"
            )
        values = None
        if metric_path:
            values = _load(metric_path, f"{where}.index_to_metric_path")
            if values.shape != ids.shape or bool((values[1:] < values[:-1]).any()):
                raise ValueError(
                    f"{where}.index_to_metric_path `{metric_path}` must hold {num_samples} "
                    f"ascending values, one per id of index_to_sample_path; {fix}"
                )
        return cls(ids, values)

    def eligible(
        self, difficulty: float, difficulty_type: str, max_difficulty: float
    ) -> torch.Tensor:
        """Ids admitted at ``difficulty``: metric <= it (``value``), or the easiest
        ``difficulty`` of ``max_difficulty`` parts (``percentile``, DeepSpeed's counting:
        ``N // max`` samples per part, all N at ``max``)."""
        n = len(self.index_to_sample)
        if difficulty_type == "value":
            assert self.index_to_metric is not None
            probe = torch.tensor([float(difficulty)], dtype=torch.float64)
            metric = self.index_to_metric.to(torch.float64)
            count = int(torch.searchsorted(metric, probe, right=True))
        elif difficulty >= max_difficulty:
            count = n
        else:
            count = int((n // max_difficulty) * difficulty)
        return self.index_to_sample[: max(0, min(count, n))]


def _load(path: str, key: str) -> torch.Tensor:
    try:
        value = torch.load(path, weights_only=True)
    except FileNotFoundError:
        raise ValueError(
            f"{key}: `{path}` does not exist; write it with zcore.data_efficiency.analyze "
            "(z train writes it when missing)"
        ) from None
    except (OSError, RuntimeError, ValueError) as error:
        raise ValueError(f"{key}: `{path}` is not an index file ({error})") from None
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{key}: `{path}` holds {type(value).__name__}, not an index tensor")
    return value
