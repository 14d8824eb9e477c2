"""Fixtures shared by the zserve model tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Run each module on one torch thread (restored after it).

    CI and dev machines run these tests beside other work on few cores; there torch's
    thread pool spends most of its time waiting for a descheduled worker (a 100-token
    SmolLM2 forward measured 0.7 s on one thread against 4-7 s on two).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
