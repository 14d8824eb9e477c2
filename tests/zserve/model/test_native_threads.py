"""A step whose projections all run on the native kernels runs torch single-threaded, and
torch's thread count is restored after it (zserve.model.native.torch_single_threaded,
LlamaModel.step_threads)."""

from __future__ import annotations

import pytest
import torch

from tests.utils.models import smollm2_dir
from zserve.engine import Engine
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


def _threads_inside(engine: Engine, tokens: int, logit_rows: int) -> int:
    with engine.runner.model.step_threads(tokens, logit_rows):
        return torch.get_num_threads()


def test_step_threads_follow_the_kernels(tmp_path) -> None:
    """A plain fp32 model keeps torch's threads for a prefill (its GEMMs are torch's) and
    drops them for a decode step; a model whose every projection and head run on znative's
    kernels (W4 with an INT8 head) drops them for every step."""
    from zquant.hf import load_model
    from zquant.ptq import quantize
    from zquant.schemes import get_recipe
    from zquant.serialize import save_quantized

    recipe = get_recipe("w4", lm_head="int8")  # `z quantize --recipe w4 --lm-head int8`
    model = load_model(smollm2_dir())
    quantize(model, recipe)
    w4 = save_quantized(model, tmp_path / "w4", recipe=recipe, source_dir=smollm2_dir())
    del model
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        plain = Engine(smollm2_dir(), max_model_len=64)
        assert _threads_inside(plain, 1, 1) == 1
        assert _threads_inside(plain, 64, 1) == 2
        assert _threads_inside(plain, 4, 16) == 2  # 16 rows through the fp32 head
        del plain
        quantized = Engine(w4, max_model_len=64)
        assert _threads_inside(quantized, 64, 1) == 1
        assert _threads_inside(quantized, 256, 16) == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(saved)
