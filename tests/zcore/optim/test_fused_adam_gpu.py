"""FusedAdamCUDA against its reference, ``torch.optim.Adam``/``AdamW``, on a GPU.

Every parity test runs the two optimizers side by side on identical parameters
and gradients and compares parameters and states. The GPU tests skip where
there is no CUDA device or no CuPy; the checks made before any launch run anywhere.
"""

from __future__ import annotations

import copy

import pytest
import torch

import znative.cuda
from zcore.optim import FusedAdamCUDA
from zcore.optim.fused_adam_cuda import CHUNK_SIZE, _host_table, fused_adam_step_

_CUPY_OK, _CUPY_WHY = znative.cuda.cupy_status()
requires_gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and _CUPY_OK),
    reason="needs a CUDA device" if not torch.cuda.is_available() else _CUPY_WHY,
)
TOL = dict(rtol=1e-5, atol=1e-6)
# Odd sizes, a 2-D one, an empty one, and one spanning three chunks of the default size.
SHAPES = [(1,), (3,), (7, 13), (1023,), (4097,), (0,), (2 * CHUNK_SIZE + 5,)]
CASES = {
    "adamw": (
        torch.optim.AdamW,
        dict(lr=1e-2, weight_decay=0.05),
        dict(decoupled_weight_decay=True),
    ),
    "adam_l2": (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1), {}),
    "adam_betas_eps": (torch.optim.Adam, dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6), {}),
    "adamw_maximize": (
        torch.optim.AdamW,
        dict(lr=1e-3, weight_decay=0.01, maximize=True),
        dict(decoupled_weight_decay=True),
    ),
}


def make_params(shapes, *, seed=0, misaligned=False):
    """Twin lists of CUDA leaf tensors with equal values: (reference, fused)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    ref, fused = [], []
    for shape in shapes:
        n, offset = torch.Size(shape).numel(), int(misaligned)
        # misaligned: a view at element offset 1, so the kernel must refuse its float4 path
        base = torch.randn(n + offset, device="cuda", generator=gen)[offset:]
        ref.append(base.clone().view(shape).requires_grad_())
        fused.append(base.view(shape).detach().requires_grad_())
    return ref, fused


def set_grads(ref, fused, step, *, every=None):
    """The same random gradients on both lists; parameter i gets one every ``every[i]`` steps."""
    gen = torch.Generator(device="cuda").manual_seed(1000 + step)
    for i, (a, b) in enumerate(zip(ref, fused, strict=True)):
        if every is not None and step % every[i]:
            a.grad = b.grad = None
            continue
        # Magnitudes from 1e-3 to 1e1 exercise both sides of eps in the denominator.
        g = torch.randn(a.shape, device="cuda", generator=gen) * 10.0 ** (step % 5 - 3)
        a.grad, b.grad = g.clone(), g.clone()


def assert_match(ref_opt, fused_opt, ref, fused):
    torch.cuda.synchronize()
    for a, b in zip(ref, fused, strict=True):
        torch.testing.assert_close(b, a, **TOL)
        assert (a in ref_opt.state) == (b in fused_opt.state)
        if a in ref_opt.state:
            sa, sb = ref_opt.state[a], fused_opt.state[b]
            torch.testing.assert_close(sb["exp_avg"], sa["exp_avg"], **TOL)
            torch.testing.assert_close(sb["exp_avg_sq"], sa["exp_avg_sq"], **TOL)
            assert sb["step"].dtype == torch.float32 and sb["step"].device.type == "cpu"
            assert sb["step"].item() == sa["step"].item()


def run_pair(ref_opt, fused_opt, ref, fused, steps, first=0, **grad_kw):
    for step in range(first, first + steps):
        set_grads(ref, fused, step, **grad_kw)
        ref_opt.step()
        fused_opt.step()
    assert_match(ref_opt, fused_opt, ref, fused)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("misaligned", [False, True], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("chunk_size", [CHUNK_SIZE, 1024])
@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_with_torch(case, chunk_size, misaligned):
    torch_cls, kwargs, extra = CASES[case]
    ref, fused = make_params(SHAPES, misaligned=misaligned)
    ref_opt = torch_cls(ref, **kwargs)
    fused_opt = FusedAdamCUDA(fused, chunk_size=chunk_size, **kwargs, **extra)
    run_pair(ref_opt, fused_opt, ref, fused, steps=25)


@pytest.mark.gpu
@requires_gpu
def test_param_groups_and_skipped_steps():
    """Groups keep their own lr; a parameter without a gradient keeps its own step count."""
    ref, fused = make_params([(513,), (77,), (4096,), (9,)])

    def groups(ps):
        return [{"params": ps[:2]}, {"params": ps[2:], "lr": 3e-3, "weight_decay": 0.0}]

    ref_opt = torch.optim.AdamW(groups(ref), lr=1e-2, weight_decay=0.1)
    fused_opt = FusedAdamCUDA(groups(fused), lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)
    run_pair(ref_opt, fused_opt, ref, fused, steps=24, every=[1, 2, 3, 1])
    assert [fused_opt.state[p]["step"].item() for p in fused] == [24.0, 12.0, 8.0, 24.0]


@pytest.mark.gpu
@requires_gpu
def test_runs_on_the_current_stream():
    ref, fused = make_params([(CHUNK_SIZE + 3,), (100,)])
    ref_opt = torch.optim.AdamW(ref, lr=1e-2)
    fused_opt = FusedAdamCUDA(fused, lr=1e-2, decoupled_weight_decay=True, weight_decay=1e-2)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        # Gradients written on `side` and consumed at once: a launch on any other
        # stream would race with these writes.
        run_pair(ref_opt, fused_opt, ref, fused, steps=20)


@pytest.mark.gpu
@requires_gpu
def test_state_dict_round_trip_with_torch_adamw():
    kwargs = dict(lr=1e-2, weight_decay=0.05)
    ref, fused = make_params(SHAPES)
    ref_opt = torch.optim.AdamW(ref, **kwargs)
    fused_opt = FusedAdamCUDA(fused, **kwargs, decoupled_weight_decay=True)
    run_pair(ref_opt, fused_opt, ref, fused, steps=10)

    saved = fused_opt.state_dict()
    assert set(saved["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert set(saved["state"][0]) == set(ref_opt.state_dict()["state"][0])

    # fused -> torch: torch resumes from our state exactly where we stand.
    resumed_ref = [p.detach().clone().requires_grad_() for p in fused]
    torch_opt = torch.optim.AdamW(resumed_ref, **kwargs)
    torch_opt.load_state_dict(copy.deepcopy(saved))
    # torch -> fused: a fresh FusedAdamCUDA resumes from torch's state.
    resumed_fused = [p.detach().clone().requires_grad_() for p in ref]
    fused_from_torch = FusedAdamCUDA(resumed_fused, lr=0.5)  # hyperparameters come from the dict
    fused_from_torch.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    assert fused_from_torch.param_groups[0]["lr"] == kwargs["lr"]
    assert fused_from_torch.param_groups[0]["decoupled_weight_decay"] is True

    run_pair(torch_opt, fused_opt, resumed_ref, fused, steps=10, first=10)
    run_pair(ref_opt, fused_from_torch, ref, resumed_fused, steps=10, first=10)


@pytest.mark.gpu
@requires_gpu
def test_functional_step_with_bf16_grads():
    """bf16 gradients against fp32 master weights match torch fed the widened gradients."""
    ref, fused = make_params([(4099,), (13,), (CHUNK_SIZE + 1,)])
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.05)
    exp_avgs = [torch.zeros_like(p) for p in fused]
    exp_avg_sqs = [torch.zeros_like(p) for p in fused]
    gen = torch.Generator(device="cuda").manual_seed(7)
    for step in range(1, 21):
        grads = [torch.randn(p.shape, device="cuda", generator=gen).bfloat16() for p in ref]
        for p, g in zip(ref, grads, strict=True):
            p.grad = g.float()  # bf16 -> fp32 is exact
        ref_opt.step()
        with torch.no_grad():
            fused_adam_step_(
                fused,
                grads,
                exp_avgs,
                exp_avg_sqs,
                step=step,
                lr=1e-2,
                weight_decay=0.05,
                decoupled_weight_decay=True,
            )
    torch.cuda.synchronize()
    for a, b, m in zip(ref, fused, exp_avgs, strict=True):
        torch.testing.assert_close(b, a, **TOL)
        torch.testing.assert_close(m, ref_opt.state[a]["exp_avg"], **TOL)


@pytest.mark.gpu
@requires_gpu
def test_trains_a_small_model_like_torch():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(33, 65), torch.nn.GELU(), torch.nn.Linear(65, 7))
    model = model.cuda()
    twin = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    fused_opt = FusedAdamCUDA(
        twin.parameters(), lr=3e-3, weight_decay=1e-2, decoupled_weight_decay=True
    )
    x, y = torch.randn(256, 33, device="cuda"), torch.randint(0, 7, (256,), device="cuda")
    for _ in range(20):
        for m, opt in ((model, ref_opt), (twin, fused_opt)):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
    losses = [torch.nn.functional.cross_entropy(m(x), y).item() for m in (model, twin)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@requires_gpu
def test_a_bad_gradient_is_named_and_nothing_is_stepped():
    """The quick per-step check fails on the bad tensor; the named check then names it, and
    no parameter of the group has moved or counted a step."""
    a = torch.nn.Parameter(torch.ones(8, device="cuda"))
    b = torch.nn.Parameter(torch.ones(8, device="cuda"))
    opt = FusedAdamCUDA([a, b], lr=0.1)
    a.grad = torch.ones(8, device="cuda")
    b.grad = torch.ones(8, device="cuda").to_sparse()
    with pytest.raises(TypeError, match=r"params\[1\]\.grad is sparse"):
        opt.step()
    assert torch.equal(a.detach(), torch.ones(8, device="cuda"))
    assert float(opt.state[a]["step"]) == 0.0
    b.grad = torch.ones(8, device="cuda")
    opt.step()
    assert float(opt.state[a]["step"]) == float(opt.state[b]["step"]) == 1.0
    assert torch.allclose(a.detach(), torch.full((8,), 0.9, device="cuda"))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize(
    "spoil, error, match",
    [
        (
            lambda b: setattr(b, "data", torch.ones(9, device="cuda")),
            ValueError,
            r"params\[1\]\.grad has shape \(8,\) but its parameter has \(9,\)",
        ),
        (
            lambda b: setattr(b, "data", b.data.half()),
            TypeError,
            r"params\[1\] dtype is torch\.float16",
        ),
        (
            lambda b: setattr(b, "grad", torch.ones(8, device="cuda").to_sparse()),
            TypeError,
            "sparse",
        ),
    ],
    ids=["param-reshaped", "param-cast", "sparse-grad"],
)
def test_a_bad_tensor_after_good_steps_is_still_named(spoil, error, match):
    """After the first step the states are recognised by identity; a parameter or gradient
    that turns bad later is still caught before any launch, and the step counters stay put."""
    a = torch.nn.Parameter(torch.ones(8, device="cuda"))
    b = torch.nn.Parameter(torch.ones(8, device="cuda"))
    opt = FusedAdamCUDA([a, b], lr=0.1)
    for _ in range(3):
        a.grad, b.grad = torch.ones(8, device="cuda"), torch.ones(8, device="cuda")
        opt.step()
    before = a.detach().clone()
    spoil(b)
    with pytest.raises(error, match=match):
        opt.step()
    assert torch.equal(a.detach(), before)
    assert float(opt.state[a]["step"]) == float(opt.state[b]["step"]) == 3.0


@pytest.mark.gpu
@requires_gpu
def test_saved_step_counters_load_into_torch_and_back_and_survive_pickling():
    """The step counters are 0-d views of one buffer: `torch.save` keeps them apart per
    parameter, torch's AdamW resumes from them, and a pickled optimizer steps on."""
    import io
    import pickle

    kwargs = dict(lr=1e-2, weight_decay=0.05)
    ref, fused = make_params([(513,), (77,), (4096,)])
    ref_opt = torch.optim.AdamW(ref, **kwargs)
    fused_opt = FusedAdamCUDA(fused, **kwargs, decoupled_weight_decay=True)
    run_pair(ref_opt, fused_opt, ref, fused, steps=6, every=[1, 2, 1])
    buf = io.BytesIO()
    torch.save(fused_opt.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert [float(loaded["state"][i]["step"]) for i in range(3)] == [6.0, 3.0, 6.0]
    resumed = [p.detach().clone().requires_grad_() for p in fused]
    torch_opt = torch.optim.AdamW(resumed, **kwargs)
    torch_opt.load_state_dict(loaded)
    again = pickle.loads(pickle.dumps(fused_opt))
    assert again.chunk_size == CHUNK_SIZE
    run_pair(torch_opt, fused_opt, resumed, fused, steps=5, first=6)
    run_pair(ref_opt, again, ref, list(again.param_groups[0]["params"]), steps=5, first=6)


# -- checks made before any launch: these run without a GPU ---------------------


def test_cpu_params_are_rejected_with_the_device():
    with pytest.raises(TypeError, match=r"params\[0\] is on device cpu.*CUDA"):
        FusedAdamCUDA([torch.zeros(3, requires_grad=True)])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lr=-1.0), "lr"),
        (dict(betas=(0.9, 1.0)), r"betas\[1\]"),
        (dict(eps=-1e-8), "eps"),
        (dict(amsgrad=True), "amsgrad"),
        (dict(chunk_size=1001), "chunk_size"),
    ],
)
def test_bad_hyperparameters_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FusedAdamCUDA([torch.zeros(3, requires_grad=True)], **kwargs)


def test_chunk_table_covers_every_element_once():
    """The table layout the kernel reads: [ptrs (T, 4) | sizes (T,) | chunks (C, 2)]."""
    rows = [(10, 11, 12, 13, 1), (20, 21, 22, 23, 8), (30, 31, 32, 33, 9)]
    table = _host_table(rows, chunk_size=4)
    t = len(rows)
    assert table.dtype == torch.int64
    assert table[: 4 * t].view(t, 4).tolist() == [list(r[:4]) for r in rows]
    assert table[4 * t : 5 * t].tolist() == [1, 8, 9]
    chunks = table[5 * t :].view(-1, 2).tolist()
    assert chunks == [[0, 0], [1, 0], [1, 4], [2, 0], [2, 4], [2, 8]]
