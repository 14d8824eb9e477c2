"""CPUAdagrad against torch.optim.Adagrad, CPULion against a torch reference
of the Lion update, both over many steps and hyperparameters."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zcore.optim import CPUAdagrad, CPULion

SHAPES = [(9,), (17, 3), (40000,)]


def make_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def set_grads(params_list, step):
    g = torch.Generator().manual_seed(500 + step)
    grads = [torch.randn(p.shape, generator=g) for p in params_list[0]]
    for params in params_list:
        for p, gr in zip(params, grads, strict=True):
            p.grad = gr.clone()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lr=st.floats(1e-3, 0.5),
    lr_decay=st.sampled_from([0.0, 1e-3, 0.1]),
    wd=st.sampled_from([0.0, 1e-3, 0.05]),
    init=st.sampled_from([0.0, 0.1]),
    maximize=st.booleans(),
    steps=st.integers(1, 20),
)
def test_adagrad_matches_torch(lr, lr_decay, wd, init, maximize, steps):
    ours_p, ref_p = make_params(), make_params()
    kw = dict(lr=lr, lr_decay=lr_decay, weight_decay=wd, initial_accumulator_value=init)
    ours = CPUAdagrad(ours_p, maximize=maximize, **kw)
    ref = torch.optim.Adagrad(ref_p, maximize=maximize, foreach=False, **kw)
    for step in range(steps):
        set_grads([ours_p, ref_p], step)
        ours.step()
        ref.step()
    for a, b in zip(ours_p, ref_p, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours.state[a]["sum"], ref.state[b]["sum"], rtol=1e-5, atol=1e-6)


def test_adagrad_state_dict_moves_to_torch():
    ours_p = make_params()
    ref_p = copy.deepcopy(ours_p)
    ours = CPUAdagrad(ours_p, lr=0.1)
    ref = torch.optim.Adagrad(ref_p, lr=0.1)
    for step in range(4):
        set_grads([ours_p, ref_p], step)
        ours.step()
        ref.step()
    moved = torch.optim.Adagrad(ours_p, lr=0.1)
    moved.load_state_dict(ours.state_dict())
    for step in range(4, 8):
        set_grads([ours_p, ref_p], step)
        moved.step()
        ref.step()
    for a, b in zip(ours_p, ref_p, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def lion_reference(params, states, lr, b1, b2, wd, maximize):
    """The Lion update (Chen et al. 2023, Algorithm 2) in plain torch."""
    for p in params:
        g = -p.grad if maximize else p.grad
        m = states.setdefault(p, torch.zeros_like(p))
        update = (b1 * m + (1 - b1) * g).sign()
        p.data.mul_(1 - lr * wd).add_(update, alpha=-lr)
        m.mul_(b2).add_(g, alpha=1 - b2)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lr=st.floats(1e-5, 1e-2),
    b1=st.floats(0.5, 0.99),
    b2=st.floats(0.9, 0.999),
    wd=st.sampled_from([0.0, 0.1, 1.0]),
    maximize=st.booleans(),
    steps=st.integers(1, 20),
)
def test_lion_matches_reference(lr, b1, b2, wd, maximize, steps):
    ours_p, ref_p = make_params(), make_params()
    ours = CPULion(ours_p, lr=lr, betas=(b1, b2), weight_decay=wd, maximize=maximize)
    states: dict = {}
    for step in range(steps):
        set_grads([ours_p, ref_p], step)
        ours.step()
        with torch.no_grad():
            lion_reference(ref_p, states, lr, b1, b2, wd, maximize)
    for a, b in zip(ours_p, ref_p, strict=True):
        # sign() can flip only where the fp32 moment is within rounding of zero: allow 2 lr.
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2 * lr)
        assert (a - b).abs().gt(1e-5 + 1e-5 * b.abs()).float().mean() < 1e-3
        torch.testing.assert_close(ours.state[a]["exp_avg"], states[b], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls", [CPUAdagrad, CPULion])
def test_bf16_states(cls):
    ours_p, ref_p = make_params(), make_params()
    ours = cls(ours_p, lr=1e-3, state_dtype=torch.bfloat16)
    ref = cls(ref_p, lr=1e-3)
    for step in range(10):
        set_grads([ours_p, ref_p], step)
        ours.step()
        ref.step()
    key = cls.state_keys[0]
    assert ours.state[ours_p[0]][key].dtype == torch.bfloat16
    for a, b in zip(ours_p, ref_p, strict=True):
        if cls is CPULion:
            # bf16 momentum flips sign() where the fp32 one is near zero: +-2 lr on few elements.
            diff = (a - b).abs()
            assert diff.max() <= 2 * 1e-3 * 10 + 1e-6
            assert diff.gt(1e-5).float().mean() < 0.01
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=10 * 1e-3 * 0.05)


def test_errors():
    (p, *_) = make_params()
    with pytest.raises(ValueError, match=r"lr_decay = -1"):
        CPUAdagrad([p], lr_decay=-1.0)
    with pytest.raises(ValueError, match=r"betas\[1\] = 1.5"):
        CPULion([p], betas=(0.9, 1.5))
    opt = CPULion([p])
    if hasattr(p, "grad_dtype"):  # torch >= 2.10 only lets a grad differ in dtype when asked
        p.grad_dtype = None
    p.grad = torch.zeros(p.shape, dtype=torch.float16)
    with pytest.raises(TypeError, match=r"grad dtype is torch.float16"):
        opt.step()
