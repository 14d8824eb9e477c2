"""TPRunner over real gloo ranks (spawned processes) on a tiny random LLaMA with an uneven
head split (6 query / 3 KV heads over 2 ranks: query 3/3 over KV heads 0-1 and 1-2), against
the single-process ModelRunner on the same ragged steps; each rank pinned to a core of its own
where there are enough.

Tolerance: fp32, max |logit difference| <= 1e-4 (tensor parallelism only changes the order
the o and down projections' partial sums are added in; measured ~1e-6 here).

The greedy tokens of a step found without gathering the logits (each rank's largest logit
of a row and its column) are the gathered logits' argmax. A rank killed mid-request, or stopped (SIGSTOP) past the collective timeout, ends the
runner with a TPRankError naming the rank and the op, within seconds.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.zserve.tiny_llama import tiny_llama, tiny_mixtral
from zserve.runner import ModelRunner, SeqChunk
from zserve.tp.group import TPRankError
from zserve.tp.runner import TPRunner, rank_cpus

ATOL = 1e-4
OPTIONS = dict(num_blocks=32, block_size=4)
UNEVEN = dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3, intermediate_size=160)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny_tp")
    tiny_llama(out, **UNEVEN)
    return out


def _steps() -> list[list[SeqChunk]]:
    """Two prompts, then their decodes beside a scored prompt chunk of one of them."""
    return [
        [
            SeqChunk(0, [5, 17, 99, 3, 42, 7, 11], 0, [3, 9]),
            SeqChunk(1, [1, 2, 3, 4, 5], 0, [1, 5]),
        ],
        [SeqChunk(0, [64], 7, [3, 9]), SeqChunk(1, [8, 9, 10], 5, [1, 5], all_logits=True)],
        [SeqChunk(0, [100], 8, [3, 9, 12]), SeqChunk(1, [77], 8, [1, 5, 7])],
        [SeqChunk(0, [101], 9, [3, 9, 12])],
    ]


def _run(runner: object) -> list[torch.Tensor]:
    return [runner.forward(chunks).clone() for chunks in _steps()]  # type: ignore[attr-defined]


@pytest.fixture()
def tp_runner(tiny_dir: Path) -> Iterator[TPRunner]:
    runner = TPRunner(tiny_dir, 2, timeout_s=3.0, **OPTIONS)
    try:
        yield runner
    finally:
        for p in runner.procs.values():  # a test may have stopped it
            if p.pid is not None and p.is_alive():
                os.kill(p.pid, signal.SIGCONT)
        runner.close()


def test_tp2_logits_equal_single_process(tiny_dir: Path, tp_runner: TPRunner) -> None:
    # a bad chunk is refused before any rank sees the batch: the ranks stay in step
    with pytest.raises(ValueError, match="out of range"):
        tp_runner.forward([SeqChunk(0, [1, 2], 0, [40])])
    whole = _run(ModelRunner(tiny_dir, **OPTIONS))
    cut = _run(tp_runner)
    for step, (a, b) in enumerate(zip(whole, cut, strict=True)):
        assert a.shape == b.shape, step
        diff = (a - b).abs().max().item()
        assert diff <= ATOL, f"step {step}: max |logit diff| {diff}"
    # the same steps again (the same keys and values rewritten), each rank sending only its
    # columns' largest logit per row: the argmax of the gathered logits, row for row
    for step, (chunks, logits) in enumerate(zip(_steps(), cut, strict=True)):
        assert tp_runner.forward_greedy(chunks) == logits.argmax(dim=-1).tolist(), step
    # rank 0 caches the 2 of the 3 KV heads its 3 query heads read, in as many blocks as the
    # whole model
    assert tp_runner.local.kv_cache.num_kv_heads == 2
    assert tp_runner.num_blocks == OPTIONS["num_blocks"]
    assert tp_runner.greedy_skips_logits
    # each rank on a core of its own where there are enough (its collectives' wake-ups stay
    # on it); rank 0's own pin is taken back at close
    threads = torch.get_num_threads()  # rank 0's share, set by TPRunner
    want = rank_cpus(1, 2, threads)
    if want is not None:
        assert os.sched_getaffinity(tp_runner.procs[1].pid) == want  # type: ignore[arg-type]


def test_rank_cpus_deal_out_the_allowed_cores() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    n = len(allowed)
    assert rank_cpus(0, n, 1) == {allowed[0]} and rank_cpus(n - 1, n, 1) == {allowed[-1]}
    assert rank_cpus(0, n + 1, 1) is None  # too few cores: not pinned
    if n >= 4:
        assert rank_cpus(1, 2, 2) == set(allowed[2:4])


def test_killed_rank_ends_the_runner_naming_it(tp_runner: TPRunner) -> None:
    tp_runner.forward(_steps()[0])
    worker = tp_runner.procs[1]
    os.kill(worker.pid, signal.SIGKILL)  # type: ignore[arg-type]
    worker.join(5)
    start = time.monotonic()
    with pytest.raises(TPRankError, match=r"rank 1 \(exit code -9\) died during .* of step 2"):
        tp_runner.forward(_steps()[1])
    assert time.monotonic() - start < 10
    with pytest.raises(TPRankError, match="rank 1"):  # and it stays down
        tp_runner.forward(_steps()[1])


def test_a_failure_on_another_thread_gives_this_thread_its_cores_back(tiny_dir: Path) -> None:
    """The server steps its engine on its own thread: a rank failing there closes the runner
    from that thread, and the thread that built the runner (pinned to rank 0's cores) must
    get its cores back all the same."""
    before = os.sched_getaffinity(0)
    runner = TPRunner(tiny_dir, 2, timeout_s=3.0, **OPTIONS)
    try:
        if rank_cpus(0, 2, 1) is not None:
            assert os.sched_getaffinity(0) == rank_cpus(0, 2, 1)
        os.kill(runner.procs[1].pid, signal.SIGKILL)  # type: ignore[arg-type]
        runner.procs[1].join(5)
        failed: list[BaseException] = []

        def step() -> None:
            try:
                runner.forward(_steps()[0])
            except TPRankError as exc:
                failed.append(exc)

        thread = threading.Thread(target=step)
        thread.start()
        thread.join(30)
        assert failed and "rank 1" in str(failed[0])
        assert os.sched_getaffinity(0) == before
    finally:
        runner.close()
    assert os.sched_getaffinity(0) == before


def test_stuck_rank_times_out_naming_the_op(tp_runner: TPRunner) -> None:
    tp_runner.forward(_steps()[0])
    os.kill(tp_runner.procs[1].pid, signal.SIGSTOP)  # type: ignore[arg-type]
    start = time.monotonic()
    with pytest.raises(
        TPRankError, match=r"all_reduce after layer 0 .* of step 2 .*every rank alive"
    ):
        tp_runner.forward(_steps()[1])
    assert time.monotonic() - start < 15


def test_tp_beyond_the_heads_fails_before_starting_ranks(tiny_dir: Path) -> None:
    from zserve.tp.plan import TPPlanError

    with pytest.raises(TPPlanError, match=r"tp 7 > num_attention_heads 6"):
        TPRunner(tiny_dir, 7, **OPTIONS)


def test_mixtral_tp2_logits_equal_single_process(tmp_path: Path) -> None:
    """Experts dealt out whole (2 of 4 a rank), the MoE output summed like a dense MLP's."""
    tiny_mixtral(tmp_path)
    whole = _run(ModelRunner(tmp_path, **OPTIONS))
    before = os.environ.get("ZNATIVE_NUM_THREADS")
    runner = TPRunner(tmp_path, 2, timeout_s=10.0, **OPTIONS)
    try:
        cut = _run(runner)
        assert runner.local.model.layers[0].mlp.gate_up.shape[0] == 2
    finally:
        runner.close()
    assert os.environ.get("ZNATIVE_NUM_THREADS") == before  # the rank share is not left set
    for step, (a, b) in enumerate(zip(whole, cut, strict=True)):
        diff = (a - b).abs().max().item()
        assert diff <= ATOL, f"step {step}: max |logit diff| {diff}"


def test_bad_quantized_directory_fails_before_starting_ranks(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 loads its shard first: a broken `z quantize` directory fails there, naming the
    file and the fix, and no rank is ever started."""
    import shutil

    import torch.multiprocessing as mp

    quant = tmp_path / "q"
    shutil.copytree(tiny_dir, quant)
    (quant / "zquant.json").write_text("{}")  # what `z quantize` writes, emptied
    monkeypatch.setattr(mp, "get_context", lambda *a: pytest.fail("a rank was started"))
    with pytest.raises(OSError, match=r"zquant.json` is not a zquant manifest; re-run"):
        TPRunner(quant, 2, **OPTIONS)
