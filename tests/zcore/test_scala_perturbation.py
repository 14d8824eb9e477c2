"""ScaLA's follower moves against their definitions: the projection is the nearest point of the
per-sample ball, the ascent step has length `step_size` along the per-sample gradient
direction (l2) or sign (linf), the random start has magnitude `init_mag`, and padding never
gets noise."""

from __future__ import annotations

import pytest
import torch

from zcore.scala.perturbation import ascend, initial, project, sample_norms

B, T, H = 5, 7, 3


def mask() -> torch.Tensor:
    return (torch.arange(T)[None] < torch.tensor([7, 5, 3, 1, 6])[:, None]).long()


def test_l2_projection_scales_only_samples_outside_the_ball() -> None:
    g = torch.Generator().manual_seed(0)
    d = torch.randn(B, T, H, generator=g) * torch.tensor([0.01, 0.1, 1.0, 10.0, 0.5])[:, None, None]
    p = project(d, 0.5, "l2")
    n = d.flatten(1).norm(dim=1)
    for b in range(B):
        want = d[b] if n[b] <= 0.5 else d[b] * 0.5 / n[b]  # the nearest point of the l2 ball
        torch.testing.assert_close(p[b], want, rtol=1e-6, atol=0)
    assert float(sample_norms(p, "l2").max()) <= 0.5 * (1 + 1e-6)


def test_linf_projection_clamps_each_element() -> None:
    d = torch.linspace(-2, 2, B * T * H).view(B, T, H)
    p = project(d, 0.3, "linf")
    torch.testing.assert_close(p, d.clamp(-0.3, 0.3))
    assert float(sample_norms(p, "linf").max()) == pytest.approx(0.3)


def test_ascent_step_length_and_direction() -> None:
    g = torch.Generator().manual_seed(1)
    d, grad = torch.randn(B, T, H, generator=g), torch.randn(B, T, H, generator=g)
    grad[2] = 0  # a sample with no gradient stays where it is
    step = ascend(d, grad, 0.25, "l2") - d
    for b in range(B):
        want = 0.0 if b == 2 else 0.25
        assert float(step[b].norm()) == pytest.approx(want, abs=1e-6)
        if b != 2:
            cos = torch.nn.functional.cosine_similarity(step[b].flatten(), grad[b].flatten(), dim=0)
            assert float(cos) == pytest.approx(1.0, abs=1e-6)
    torch.testing.assert_close(ascend(d, grad, 0.25, "linf") - d, 0.25 * grad.sign())


@pytest.mark.parametrize("norm", ["l2", "linf"])
def test_random_start_and_ascent_stay_in_the_bound_and_off_the_padding(norm: str) -> None:
    m, g = mask(), torch.Generator().manual_seed(2)
    d = initial((B, T, H), 0.2, norm, mask=m, generator=g)  # type: ignore[arg-type]
    norms = sample_norms(d, norm)  # type: ignore[arg-type]
    if norm == "l2":
        torch.testing.assert_close(norms, torch.full((B,), 0.2))
    else:
        assert float(norms.max()) <= 0.2 and float(norms.min()) > 0.1
    for _ in range(20):  # many big steps: the projection keeps every sample within 0.5
        grad = torch.randn(B, T, H, generator=g)
        d = project(ascend(d, grad, 0.4, norm, m), 0.5, norm, m)  # type: ignore[arg-type]
        assert float(sample_norms(d, norm).max()) <= 0.5 * (1 + 1e-6)  # type: ignore[arg-type]
        assert float(d[m == 0].abs().max()) == 0.0
    assert float(sample_norms(d, norm).min()) > 0.4  # type: ignore[arg-type]  # it reached the rim
    assert torch.equal(initial((B, T, H), 0.0, norm), torch.zeros(B, T, H))  # type: ignore[arg-type]


def test_a_mask_of_the_wrong_shape_is_named() -> None:
    with pytest.raises(ValueError, match=r"mask shape \(5, 6\) does not match.*\(5, 7, 3\)"):
        project(torch.zeros(B, T, H), 1.0, "l2", torch.ones(B, T - 1))
