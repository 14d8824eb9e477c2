"""`zserve.cpu_idle`: the engine's hold on Linux's CPU latency QoS, read back from the kernel.

`/dev/cpu_dma_latency` reads back the request the kernel honours (the smallest any process
holds): 0 while a hold is taken, the value from before once it is given back. The engine
takes it at its first forward and gives it back when nothing is unfinished (finished or
aborted) and at close; at tp=1 (`auto`) and with `halt` it never takes it. Where the device
cannot be written (`poll` asked for), the engine fails at start naming the device and the fix.

The kernel's request is global: the cases that read it need write access (root) and skip
without it.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

import zserve
from tests.utils.tiny_lm import write_tiny_lm
from zserve.config import EngineConfig
from zserve.cpu_idle import (
    QOS_DEVICE,
    CpuIdleError,
    IdlePolling,
    current_request,
    unavailable,
)
from zserve.engine import Engine
from zserve.sampling import SamplingParams

needs_qos = pytest.mark.skipif(
    unavailable() is not None, reason=f"`{QOS_DEVICE}` is not writable here (root, Linux)"
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_lm(tmp_path_factory.mktemp("cpu_idle") / "lm")


@needs_qos
def test_hold_requests_zero_and_release_gives_it_back() -> None:
    before = current_request()
    hold = IdlePolling()
    hold.hold()
    hold.hold()  # held already: no second request
    assert hold.held and current_request() == 0
    hold.release()
    hold.release()
    assert not hold.held and current_request() == before


@needs_qos
def test_a_hold_dropped_unreleased_is_given_back() -> None:
    before = current_request()
    hold = IdlePolling()
    hold.hold()
    assert current_request() == 0
    del hold
    gc.collect()
    assert current_request() == before


def test_poll_without_the_device_fails_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-device"
    with pytest.raises(CpuIdleError, match="no-such-device") as err:
        IdlePolling.for_engine("poll", 2, device=str(missing))
    assert "cpu_idle 'auto' or 'halt'" in str(err.value)
    assert isinstance(err.value, OSError)


def test_poll_on_the_static_baseline_is_refused() -> None:
    with pytest.raises(ValueError, match="cpu_idle 'poll' is held by the engine"):
        EngineConfig(policy="static", cpu_idle="poll")


def test_auto_and_halt_take_no_hold_where_they_should_not(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-device")
    assert IdlePolling.for_engine("auto", 2, device=missing) is None  # not allowed: halt
    assert IdlePolling.for_engine("auto", 1) is None  # one process: its threads wait on none
    assert IdlePolling.for_engine("halt", 4) is None


@needs_qos
def test_tp2_engine_polls_while_requests_are_in_flight(tiny_dir: Path) -> None:
    before = current_request()
    engine = Engine(tiny_dir, tp=2, max_model_len=64, num_blocks=16)
    try:
        assert current_request() == before  # an idle engine holds nothing
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        engine.add_request("a", "To be, or not to be", params)
        engine.step()
        assert current_request() == 0
        while engine.has_unfinished():
            engine.step()
        assert current_request() == before  # finished: given back
        engine.add_request("b", "Now is the winter", params)
        engine.step()
        assert current_request() == 0
        engine.abort("b")
        assert current_request() == before  # aborted: given back without another step
        engine.add_request("c", "Friends, Romans", params)
        engine.step()
    finally:
        engine.close()
    assert current_request() == before  # closed mid-request: given back


@needs_qos
def test_tp1_polls_only_when_asked(tiny_dir: Path) -> None:
    before = current_request()
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    for mode, want in (("auto", before), ("poll", 0)):
        engine = Engine(tiny_dir, cpu_idle=mode, max_model_len=64, num_blocks=16)
        try:
            engine.add_request("a", "To be, or not to be", params)
            engine.step()
            assert current_request() == want, mode
        finally:
            engine.close()
        assert current_request() == before


@needs_qos
def test_tp2_output_is_the_same_with_halting_cores(tiny_dir: Path) -> None:
    options = dict(max_model_len=64, num_blocks=16)
    with zserve.pipeline(tiny_dir, tp=2, cpu_idle="halt", **options) as halt:
        want = halt(["To be, or not to be"], max_tokens=6, temperature=0)
        assert not halt.engine.polls_idle_cores
    with zserve.pipeline(tiny_dir, tp=2, cpu_idle="poll", **options) as poll:
        got = poll(["To be, or not to be"], max_tokens=6, temperature=0)
        assert poll.engine.polls_idle_cores
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
