"""``model.apply(fn)`` inside zero.Init: full parameters around ``fn``, once per module."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import zcore
from tests.utils.distributed import run_ranks
from tests.zcore.zero.common import baseline, config, full_params, make_model, train
from zcore.zero import GatheredParameters, Init


def _initializer() -> tuple[Callable[[nn.Module], None], list[str]]:
    """An HF-style ``_init_weights``: Linear weights from a generator seeded per call (so a
    module visited twice, or out of order, ends with other values), embeddings from the
    global RNG, LayerNorms filled by a formula. Returns it and the log of its calls."""
    calls: list[str] = []

    def init(m: nn.Module) -> None:
        calls.append(type(m).__name__)
        g = torch.Generator().manual_seed(len(calls))
        with torch.no_grad():
            if isinstance(m, nn.Linear):
                m.weight.normal_(0.0, 0.2, generator=g)
                if m.bias is not None:
                    m.bias.uniform_(-0.1, 0.1, generator=g)
            elif isinstance(m, nn.Embedding):
                m.weight.normal_(0.0, 0.5)  # global RNG: differs per rank in the test
            elif isinstance(m, nn.LayerNorm):
                m.weight.copy_(torch.linspace(0.5, 1.5, m.weight.numel()))
                m.bias.fill_(0.01 * len(calls))

    return init, calls


def _reference() -> tuple[nn.Module, list[str]]:
    """The same construction and initialisation on a plain model (rank 0's RNG)."""
    model = make_model()
    init, calls = _initializer()
    torch.manual_seed(0)
    model.apply(init)
    return model, calls


def _apply_inside_init(rank: int, world: int) -> dict:
    with Init(persistence_threshold=30):
        model = make_model()
        init, calls = _initializer()
        torch.manual_seed(rank)  # ranks draw differently; rank 0's values must win
        model.apply(init)
    empty = {n: p.numel() == 0 for n, p in model.named_parameters()}
    with GatheredParameters(list(model.parameters())):
        initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine, *_ = zcore.initialize(model, config=config(3))
    losses = train(engine, 2)
    return {
        "calls": calls,
        "empty": empty,
        "initial": initial,
        "losses": losses,
        "params": full_params(engine),
    }


def test_apply_inside_init_initialises_nested_modules_like_the_plain_model() -> None:
    ref, ref_calls = _reference()
    ref_initial = {n: p.detach().clone() for n, p in ref.named_parameters()}
    ref_losses, ref_params = baseline(2, global_size=8, model=ref)
    for r in run_ranks(_apply_inside_init, 2):
        # fn ran once per module, in nn.Module.apply's order
        assert r["calls"] == ref_calls
        # re-cut and released again: large parameters hold no data after apply
        assert r["empty"]["blocks.1.fc.weight"] and r["empty"]["emb.weight"]
        assert not r["empty"]["blocks.1.ln.weight"]  # persistent (24 <= 30 elements)
        for name, value in ref_initial.items():
            torch.testing.assert_close(r["initial"][name], value, atol=0, rtol=0, msg=name)
        assert r["losses"] == pytest.approx(ref_losses, abs=2e-5)
        for name, value in ref_params.items():
            torch.testing.assert_close(r["params"][name], value, atol=1e-4, rtol=0, msg=name)
