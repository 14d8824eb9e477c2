"""Test-wide settings.

Hypothesis runs derandomized: every run (and CI) explores the same examples, so
a failure reproduces and a green run means the same thing each time. Set
`HYPOTHESIS_PROFILE=explore` to draw fresh examples while developing.

Every test runs on one torch intra-op thread: CI and dev machines run the suite on
few cores beside other work, where torch's pool spends most of its time waiting for
a descheduled worker (a 100-token SmolLM2 forward measured 0.7 s on one thread against
4-7 s on two; the tiny-GPT overfit loop ran 10x slower). Multi-rank tests set the same
in each rank (`tests.utils.distributed`). Code under test may set its own count (ztrain's
`Trainer.start` takes every core a rank has): it is put back to one after each test, so a
test's arithmetic never depends on which tests ran before it in the same process.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from hypothesis import settings

# The default suite's per-test budget and the slow tests' timeouts (tests/budget.py).
pytest_plugins = ["tests.budget"]

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("explore", deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def threads_put_back() -> Iterator[None]:
    yield
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def environment_put_back() -> Iterator[None]:
    """Each test leaves ``os.environ`` as it found it.

    A benchmark run in-process sets variables for its own process (``ZNATIVE_NUM_THREADS``
    in ``_serve_compare``, for one); left set, they would reach every later test of the
    worker and every child it starts, as a ``z doctor`` subprocess once showed.
    """
    before = dict(os.environ)
    yield
    for key in [k for k in os.environ if k not in before]:
        del os.environ[key]
    for key, value in before.items():
        if os.environ.get(key) != value:
            os.environ[key] = value
