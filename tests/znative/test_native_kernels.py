"""The compiled module on its own: numpy buffers, typed errors that subclass
builtins and leave buffers untouched, SIMD variants that agree, GIL release."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import znative

ADAM = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)


def buffers(n=1000, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n).astype(np.float32) for _ in range(2)] + [
        np.zeros(n, np.float32),
        np.zeros(n, np.float32),
    ]


def test_exceptions_subclass_builtins():
    assert issubclass(znative.ShapeMismatchError, ValueError)
    assert issubclass(znative.HyperparameterError, ValueError)
    assert issubclass(znative.LayoutError, ValueError)
    assert issubclass(znative.SimdError, ValueError)
    assert issubclass(znative.DTypeError, TypeError)


@pytest.mark.parametrize(
    ("mutate", "exc", "match"),
    [
        (lambda b: b.__setitem__(1, b[1][:-1]), znative.ShapeMismatchError, "grads has 999"),
        (
            lambda b: b.__setitem__(0, b[0].astype(np.float64)),
            znative.DTypeError,
            "params.*float64",
        ),
        (lambda b: b.__setitem__(1, b[1].astype(np.float16)), znative.DTypeError, "grads"),
        (lambda b: b.__setitem__(3, b[3].astype(np.int32)), znative.DTypeError, "exp_avg_sq"),
        (lambda b: b.__setitem__(1, [0.0] * 1000), znative.DTypeError, "numpy array.*list"),
        (
            lambda b: b.__setitem__(0, np.zeros((1000, 2), np.float32)[:, 0]),
            znative.LayoutError,
            "not C-contiguous",
        ),
        (lambda b: b[0].setflags(write=False), znative.LayoutError, "params.*writeable"),
        (lambda b: b.__setitem__(3, b[2]), znative.LayoutError, "alias"),
        (
            lambda b: b.__setitem__(3, np.zeros(1000, np.uint16)),
            znative.DTypeError,
            "share one dtype",
        ),
    ],
)
def test_bad_buffers_raise_and_change_nothing(mutate, exc, match):
    b = buffers()
    mutate(b)
    before = [np.array(x, copy=True) if isinstance(x, np.ndarray) else x for x in b]
    with pytest.raises(exc, match=match):
        znative.adam_step(*b, **ADAM)
    for x, y in zip(b, before, strict=True):
        if isinstance(x, np.ndarray):
            np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize(
    ("field", "value"),
    [("lr", -1.0), ("beta1", 1.0), ("beta2", -0.1), ("eps", float("inf")), ("step", 0)],
)
def test_bad_hyperparameters(field, value):
    b = buffers()
    before = b[0].copy()
    with pytest.raises(znative.HyperparameterError, match=f"invalid {field}"):
        znative.adam_step(*b, **{**ADAM, field: value})
    np.testing.assert_array_equal(b[0], before)


def test_simd_levels_agree_and_can_be_forced():
    detected = znative.detected_simd_level()
    assert detected in ("avx512", "avx2", "scalar")
    order = ["scalar", "avx2", "avx512"]
    results = {}
    try:
        for level in order[: order.index(detected) + 1]:
            znative.set_simd_level(level)
            assert znative.simd_level() == level
            b = buffers(3 * 65536 + 5)
            znative.adam_step(*b, **{**ADAM, "weight_decay": 0.01})
            results[level] = b[0]
        with pytest.raises(znative.SimdError, match=r"unknown SIMD level `sse9`"):
            znative.set_simd_level("sse9")
    finally:
        znative.set_simd_level(None)
    assert znative.simd_level() == detected
    for level, r in results.items():
        np.testing.assert_allclose(r, results["scalar"], rtol=1e-6, atol=1e-7, err_msg=level)


def test_bf16_as_int16_and_uint16_views_are_the_same_bits():
    n = 4096
    b16 = buffers(n)
    b16u = buffers(n)
    m, v = np.zeros(n, np.int16), np.zeros(n, np.int16)
    mu, vu = np.zeros(n, np.uint16), np.zeros(n, np.uint16)
    znative.adam_step(b16[0], b16[1], m, v, **ADAM)
    znative.adam_step(b16u[0], b16u[1], mu, vu, **ADAM)
    np.testing.assert_array_equal(m.view(np.uint16), mu)
    np.testing.assert_array_equal(b16[0], b16u[0])


def test_kernel_releases_the_gil():
    # 30 M elements: each call takes tens of ms. While it runs, a pure-Python loop in this
    # thread must keep making progress, which it cannot if the call holds the GIL.
    n = 30_000_000
    p, g = np.ones(n, np.float32), np.full(n, 0.5, np.float32)
    m, v = np.zeros(n, np.float32), np.zeros(n, np.float32)
    window = {}

    def work():
        window["start"] = time.perf_counter()
        for step in range(1, 4):
            znative.adam_step(p, g, m, v, **{**ADAM, "step": step})
        window["end"] = time.perf_counter()

    t = threading.Thread(target=work)
    ticks = []
    t.start()
    while t.is_alive():
        ticks.append(time.perf_counter())
    t.join()
    inside = [x for x in ticks if window["start"] + 0.005 < x < window["end"] - 0.005]
    assert window["end"] - window["start"] > 0.02
    assert len(inside) > 1000, f"only {len(inside)} Python iterations ran during the kernel"


def test_stream_probe_and_threads():
    a, b, c, d = (np.full(50000, x, np.float32) for x in (1.0, 2.0, 4.0, 8.0))
    znative.stream_4r3w(a, b, c, d)
    np.testing.assert_array_equal(a, np.full(50000, 0.5 - 6.0 + 4.0, np.float32))
    # The bf16-state layout: 16-bit states (bfloat16 bits as int16) flip their lowest bit.
    c16, d16 = np.full(50000, 0x3F80, np.int16), np.zeros(50000, np.int16)
    znative.stream_4r3w(a, b, c16, d16)
    np.testing.assert_array_equal(a, np.full(50000, -1.5 / 2 + 2.0, np.float32))
    assert (c16 == 0x3F81).all() and (d16 == 1).all()
    with pytest.raises(znative.DTypeError, match="share one dtype"):
        znative.stream_4r3w(a, b, c, d16)
    # Paced: d goes through `pace` rounds of sqrt(y) / (y + 1) from |d| first.
    a, c, d = (np.full(50000, x, np.float32) for x in (1.0, 4.0, -8.0))
    znative.stream_4r3w(a, b, c, d, pace=1)
    y = np.float32(np.sqrt(np.float32(8.0)) / np.float32(9.0))
    np.testing.assert_array_equal(d, np.full(50000, np.float32(0.5) * y + 2, np.float32))
    with pytest.raises(znative.HyperparameterError, match="pace"):
        znative.stream_4r3w(a, b, c, d, pace=4)
    assert znative.num_threads() >= 1
