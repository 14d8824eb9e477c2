"""CPUAdam / CPUAdamW against torch.optim.Adam / AdamW over many steps and
hyperparameters, bf16 states against an exact bf16-storage reference, state
dict round trips in both directions, and the error paths."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zcore.optim import CPUAdagrad, CPUAdam, CPUAdamW
from zcore.optim.functional import adam_step

SHAPES = [(7,), (33, 5), (1,), (3, 4, 5)]


def make_params(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def set_grads(params_list, step, scale=1.0):
    """Give every parameter list the same fresh gradients."""
    g = torch.Generator().manual_seed(1000 + step)
    grads = [torch.randn(p.shape, generator=g) * scale for p in params_list[0]]
    for params in params_list:
        for p, gr in zip(params, grads, strict=True):
            p.grad = gr.clone()


hyper = st.fixed_dictionaries(
    {
        "lr": st.floats(1e-4, 1e-1),
        "beta1": st.floats(0.0, 0.99),
        "beta2": st.floats(0.9, 0.9999),
        "eps": st.sampled_from([1e-8, 1e-6, 1e-3]),
        "weight_decay": st.sampled_from([0.0, 1e-4, 1e-2, 0.1]),
        "decoupled": st.booleans(),
        "maximize": st.booleans(),
        "steps": st.integers(1, 25),
    }
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(h=hyper)
def test_matches_torch_adam(h):
    ours_p, ref_p = make_params(SHAPES), make_params(SHAPES)
    kw = dict(
        lr=h["lr"],
        betas=(h["beta1"], h["beta2"]),
        eps=h["eps"],
        weight_decay=h["weight_decay"],
        maximize=h["maximize"],
        decoupled_weight_decay=h["decoupled"],
    )
    ours = CPUAdam(ours_p, **kw)
    ref = torch.optim.Adam(ref_p, foreach=False, **kw)
    for step in range(h["steps"]):
        set_grads([ours_p, ref_p], step)
        ours.step()
        ref.step()
    for a, b in zip(ours_p, ref_p, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(ours_p, ref_p, strict=True):
        for key in ("exp_avg", "exp_avg_sq"):
            # m = b1*m + (1-b1)*g vs torch's lerp: equal up to fp32 rounding under cancellation.
            torch.testing.assert_close(ours.state[a][key], ref.state[b][key], rtol=1e-5, atol=1e-6)
        assert ours.state[a]["step"].item() == ref.state[b]["step"].item() == h["steps"]


def test_adamw_large_parallel_tensor_and_param_groups():
    # One tensor big enough to be split across the thread pool, plus a second group.
    shapes = [(3 * 65536 + 11,), (64, 3)]
    ours_p, ref_p = make_params(shapes), make_params(shapes)
    ours = CPUAdamW(
        [{"params": ours_p[:1]}, {"params": ours_p[1:], "lr": 1e-2, "weight_decay": 0.0}],
        lr=3e-3,
        weight_decay=0.05,
    )
    ref = torch.optim.AdamW(
        [{"params": ref_p[:1]}, {"params": ref_p[1:], "lr": 1e-2, "weight_decay": 0.0}],
        lr=3e-3,
        weight_decay=0.05,
    )
    for step in range(30):
        set_grads([ours_p, ref_p], step)
        if step % 7 == 3:  # a step where one parameter has no gradient is skipped for it
            ours_p[1].grad = ref_p[1].grad = None
        ours.step()
        ref.step()
    for a, b in zip(ours_p, ref_p, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def bf16_reference_step(p, g, m, v, step, lr, b1, b2, eps):
    """torch Adam math in fp32 with exp_avg/exp_avg_sq stored as bfloat16 between steps."""
    mf = b1 * m.float() + (1 - b1) * g
    vf = b2 * v.float() + (1 - b2) * g * g
    bc1, bc2 = 1 - b1**step, 1 - b2**step
    denom = vf.sqrt() * (1 / bc2**0.5) + eps
    p.sub_(lr / bc1 * mf / denom)
    m.copy_(mf.to(torch.bfloat16))
    v.copy_(vf.to(torch.bfloat16))


def test_bf16_states_match_bf16_storage_reference():
    n = 5000
    (p,) = make_params([(n,)])
    q = p.detach().clone()
    m = torch.zeros(n, dtype=torch.bfloat16)
    v = torch.zeros(n, dtype=torch.bfloat16)
    opt = CPUAdam([p], lr=1e-2, state_dtype=torch.bfloat16)
    for step in range(1, 21):
        set_grads([[p]], step)
        bf16_reference_step(q, p.grad, m, v, step, 1e-2, 0.9, 0.999, 1e-8)
        opt.step()
    assert opt.state[p]["exp_avg"].dtype == torch.bfloat16
    # Same rounding of the same fp32 values: states agree to one bf16 ulp, params closely.
    torch.testing.assert_close(opt.state[p]["exp_avg"], m, rtol=8e-3, atol=1e-6)
    torch.testing.assert_close(opt.state[p]["exp_avg_sq"], v, rtol=8e-3, atol=1e-9)
    torch.testing.assert_close(p.detach(), q, rtol=1e-5, atol=2e-6)


def test_bf16_states_track_fp32_training():
    # bf16 states are an approximation of fp32 Adam; on 20 steps of lr 1e-2 the drift is small.
    ours_p, ref_p = make_params(SHAPES), make_params(SHAPES)
    ours = CPUAdam(ours_p, lr=1e-2, state_dtype=torch.bfloat16)
    ref = torch.optim.Adam(ref_p, lr=1e-2)
    for step in range(20):
        set_grads([ours_p, ref_p], step)
        ours.step()
        ref.step()
    for a, b in zip(ours_p, ref_p, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=20 * 1e-2 * 0.02)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_functional_bf16_grads(state_dtype):
    n = 40000
    (p,) = make_params([(n,)])
    q = p.detach().clone()
    m, v = torch.zeros(n, dtype=state_dtype), torch.zeros(n, dtype=state_dtype)
    mr, vr = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    ref = torch.optim.Adam([qq := torch.nn.Parameter(q.clone())], lr=1e-3)
    for step in range(1, 6):
        g = (torch.randn(n, generator=torch.Generator().manual_seed(step)) * 0.1).to(torch.bfloat16)
        adam_step(p.data, g, m, v, step=step, lr=1e-3)
        if state_dtype == torch.bfloat16:
            bf16_reference_step(q, g.float(), mr, vr, step, 1e-3, 0.9, 0.999, 1e-8)
        else:
            qq.grad = g.float()
            ref.step()
    expect = q if state_dtype == torch.bfloat16 else qq.detach()
    torch.testing.assert_close(p.detach(), expect, rtol=1e-5, atol=1e-6)


def test_state_dict_round_trip_with_torch_both_ways():
    """torch Adam -> CPUAdam -> torch Adam mid-run gives the uninterrupted torch trajectory."""
    base = make_params(SHAPES)
    ref_p = copy.deepcopy(base)
    ref = torch.optim.Adam(ref_p, lr=1e-2, weight_decay=0.01)
    run_p = copy.deepcopy(base)
    opt = torch.optim.Adam(run_p, lr=1e-2, weight_decay=0.01)
    for step in range(15):
        set_grads([ref_p, run_p], step)
        ref.step()
        if step == 5:  # switch torch -> ours
            sd = opt.state_dict()
            opt = CPUAdam(run_p, lr=1e-2, weight_decay=0.01)
            opt.load_state_dict(sd)
        if step == 10:  # switch ours -> torch
            sd = opt.state_dict()
            assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
            assert sd["state"][0]["step"].dtype == torch.float32
            opt = torch.optim.Adam(run_p, lr=1e-2, weight_decay=0.01)
            opt.load_state_dict(sd)
        opt.step()
    for a, b in zip(run_p, ref_p, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bf16_state_dict_reload_keeps_bf16_and_continues_identically():
    p1 = make_params(SHAPES)
    p2 = copy.deepcopy(p1)
    o1 = CPUAdam(p1, lr=1e-2, state_dtype=torch.bfloat16)
    for step in range(3):
        set_grads([p1], step)
        o1.step()
    sd = copy.deepcopy(o1.state_dict())
    for a, b in zip(p2, p1, strict=True):
        a.data.copy_(b.data)
    o2 = CPUAdam(p2, lr=1e-2, state_dtype=torch.bfloat16)
    o2.load_state_dict(sd)
    assert all(s["exp_avg"].dtype == torch.bfloat16 for s in o2.state.values())
    for step in range(3, 6):
        set_grads([p1, p2], step)
        o1.step()
        o2.step()
    for a, b in zip(p1, p2, strict=True):
        assert torch.equal(a, b)


def snapshot(opt, params):
    return [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict())


def test_bad_second_param_changes_nothing():
    params = make_params([(10,), (4, 4)])
    opt = CPUAdam(params, lr=1e-2)
    set_grads([params], 0)
    opt.step()
    before, sd_before = snapshot(opt, params)
    set_grads([params], 1)
    params[1].grad = torch.randn(4, 4).t()  # same shape, not contiguous
    with pytest.raises(ValueError, match=r"param_groups\[0\]\.params\[1\].*grad.*contiguous"):
        opt.step()
    for a, b in zip(params, before, strict=True):
        assert torch.equal(a.detach(), b)
    assert all(s["step"].item() == 1 for s in opt.state.values())
    torch.testing.assert_close(opt.state_dict()["state"], sd_before["state"])


def test_invalid_hyperparameters_and_params_raise_clearly():
    (p,) = make_params([(4,)])
    with pytest.raises(ValueError, match=r"invalid lr = -1.0"):
        CPUAdam([p], lr=-1.0)
    with pytest.raises(ValueError, match=r"betas\[0\] = 1.0"):
        CPUAdam([p], betas=(1.0, 0.999))
    with pytest.raises(ValueError, match=r"amsgrad"):
        CPUAdam([p], amsgrad=True)
    with pytest.raises(ValueError, match=r"state_dtype"):
        CPUAdam([p], state_dtype=torch.float16)
    with pytest.raises(TypeError, match=r"float64.*fp32"):
        CPUAdam([torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))])
    with pytest.raises(TypeError, match=r"meta.*CPU"):
        CPUAdam([torch.nn.Parameter(torch.zeros(3, device="meta"))])
    with pytest.raises(ValueError, match=r"not contiguous"):
        CPUAdam([torch.nn.Parameter(torch.zeros(4, 4).t())])
    # A scheduler setting a bad lr mid-run is caught before any parameter moves.
    opt = CPUAdam([p], lr=1e-3)
    p.grad = torch.ones(4)
    opt.param_groups[0]["lr"] = float("nan")
    before = p.detach().clone()
    with pytest.raises(ValueError, match=r"lr = nan"):
        opt.step()
    assert torch.equal(p.detach(), before)


def test_functional_rejects_mismatch_and_leaves_buffers():
    p = torch.ones(8)
    m, v = torch.zeros(8), torch.zeros(8)
    with pytest.raises(ValueError, match=r"grad has 7 elements.*8"):
        adam_step(p, torch.ones(7), m, v, step=1)
    with pytest.raises(TypeError, match=r"float16"):
        adam_step(p, torch.ones(8, dtype=torch.float16), m, v, step=1)
    with pytest.raises(ValueError, match=r"step = 0"):
        adam_step(p, torch.ones(8), m, v, step=0)
    assert torch.equal(p, torch.ones(8)) and not m.any() and not v.any()


@pytest.mark.gpu
def test_cuda_param_rejected_by_cpu_optimizer():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    with pytest.raises(TypeError, match=r"cuda.*CPU"):
        CPUAdam([torch.nn.Parameter(torch.zeros(3, device="cuda"))])


def test_bf16_grad_on_fp32_param_through_optimizer():
    (p,) = make_params([(3000,)])
    if not hasattr(p, "grad_dtype"):
        pytest.skip("this torch cannot attach a bf16 grad to an fp32 parameter")
    ref_p = torch.nn.Parameter(p.detach().clone())
    p.grad_dtype = None
    opt, ref = CPUAdam([p], lr=1e-2), torch.optim.Adam([ref_p], lr=1e-2)
    for step in range(5):
        g = torch.randn(3000, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
        p.grad, ref_p.grad = g, g.float()
        opt.step()
        ref.step()
    torch.testing.assert_close(p.detach(), ref_p.detach(), rtol=1e-5, atol=1e-6)


def test_large_states_train_and_checkpoint_like_torch():
    import io

    from zcore.optim._buffers import new_state

    n = (4 << 20) // 4 + 4097  # a 4 MiB+ state, split across the kernel threads
    s = new_state(torch.empty(n // 2, 2), torch.bfloat16, fill=0.5)
    assert s.shape == (n // 2, 2) and s.dtype == torch.bfloat16 and bool((s == 0.5).all())
    ours_p, ref_p = make_params([(n,)]), make_params([(n,)])
    ours = CPUAdagrad(ours_p, lr=0.1, initial_accumulator_value=0.2)
    ref = torch.optim.Adagrad(ref_p, lr=0.1, initial_accumulator_value=0.2)
    for step in range(3):
        set_grads([ours_p, ref_p], step)
        ours.step()
        ref.step()
    torch.testing.assert_close(ours_p[0], ref_p[0], rtol=1e-5, atol=1e-6)
    buf = io.BytesIO()
    torch.save(ours.state_dict(), buf)
    buf.seek(0)
    reloaded = CPUAdagrad(ours_p, lr=0.1)
    reloaded.load_state_dict(torch.load(buf))
    assert torch.equal(reloaded.state[ours_p[0]]["sum"], ours.state[ours_p[0]]["sum"])
    set_grads([ours_p, ref_p], 3)
    reloaded.step()
    ref.step()
    torch.testing.assert_close(ours_p[0], ref_p[0], rtol=1e-5, atol=1e-6)
