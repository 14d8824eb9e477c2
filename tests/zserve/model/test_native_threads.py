"""A decode step on the native kernels runs torch single-threaded, and torch's thread count
is restored after it (zserve.model.native.torch_single_threaded)."""

from __future__ import annotations

import pytest
import torch

from zserve.model.native import torch_single_threaded


@pytest.mark.parametrize("active", [True, False])
def test_threads_inside_and_restored(active: bool) -> None:
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch_single_threaded(active):
            assert torch.get_num_threads() == (1 if active else 2)
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError), torch_single_threaded(active):
            raise RuntimeError("a failing step")
        assert torch.get_num_threads() == 2  # restored on the error path too
    finally:
        torch.set_num_threads(saved)
