"""The follower's moves in ScaLA: start, ascend, project a perturbation of the embedding output.

Pure tensor functions, readable next to the driver (:mod:`zcore.scala.scala`) and tested
against the definitions directly. ``delta`` has the embedding output's shape, ``(B, T, H)``
for token embeddings; a sample is one row ``delta[b]``, and its norm is taken over all of
its elements (``l2``: the Frobenius norm over ``T x H``; ``linf``: the largest magnitude).
``mask`` (``(B, T)``, 1 for real tokens, 0 for padding), when given, zeroes ``delta`` at the
padding so the noise and its norm cover only the tokens the model attends to.

Per-sample normalization (``l2``) and the elementwise sign (``linf``) make each sample's
ascent step independent of the other samples and of how the loss is averaged, so splitting a
batch across data-parallel ranks gives each sample the same perturbation as one process
holding the whole batch.
"""

from __future__ import annotations

import torch

from zcore.scala.config import NormType

_TINY = 1e-12


def _masked(x_BTH: torch.Tensor, mask_BT: torch.Tensor | None) -> torch.Tensor:
    if mask_BT is None:
        return x_BTH
    if tuple(mask_BT.shape) != tuple(x_BTH.shape[:2]):
        raise ValueError(
            f"scala: mask shape {tuple(mask_BT.shape)} does not match the embedding output "
            f"{tuple(x_BTH.shape)}; pass the batch's (batch, tokens) attention mask"
        )
    shape = (*mask_BT.shape, *([1] * (x_BTH.dim() - 2)))
    return x_BTH * mask_BT.reshape(shape).to(x_BTH.dtype)


def sample_norms(delta: torch.Tensor, norm: NormType) -> torch.Tensor:
    """Each sample's norm, shape ``(B,)``."""
    flat = delta.reshape(delta.shape[0], -1)
    if norm == "l2":
        return flat.norm(dim=1)
    return flat.abs().amax(dim=1) if flat.shape[1] else flat.new_zeros(flat.shape[0])


def _per_sample(v_B: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return v_B.reshape(-1, *([1] * (like.dim() - 1)))


def project(
    delta: torch.Tensor, max_norm: float, norm: NormType, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The nearest point of the ball ``{||delta[b]|| <= max_norm}`` (each sample alone):
    ``l2`` rescales a sample whose norm exceeds the radius, ``linf`` clamps each element."""
    delta = _masked(delta, mask)
    if norm == "linf":
        return delta.clamp(-max_norm, max_norm)
    n = sample_norms(delta, "l2")
    scale = torch.where(n > max_norm, max_norm / n.clamp_min(_TINY), torch.ones_like(n))
    return delta * _per_sample(scale, delta)


def ascend(
    delta: torch.Tensor,
    grad: torch.Tensor,
    step_size: float,
    norm: NormType,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One ascent step on the loss: ``l2`` moves each sample by ``step_size`` along its own
    normalized gradient (a zero gradient leaves it), ``linf`` every element by ``step_size``
    along the gradient's sign. Not yet projected."""
    grad = _masked(grad, mask)
    if norm == "linf":
        return delta + step_size * grad.sign()
    n = sample_norms(grad, "l2")
    return delta + step_size * grad / _per_sample(n.clamp_min(_TINY), grad)


def initial(
    shape: torch.Size | tuple[int, ...],
    init_mag: float,
    norm: NormType,
    *,
    mask: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """The start ``delta_0`` (fp32): zero for ``init_mag`` 0; ``l2``: a uniformly random
    direction scaled to norm ``init_mag`` per sample (over the unmasked positions); ``linf``:
    uniform in ``[-init_mag, init_mag]``. Drawn on the CPU from ``generator`` (a CPU
    generator), then moved to ``device``, so a seed gives the same start on any device."""
    if init_mag == 0:
        return torch.zeros(shape, device=device)
    if norm == "linf":
        u = torch.rand(shape, generator=generator).to(device) * 2 - 1
        return _masked(u * init_mag, mask)
    u = _masked(torch.randn(shape, generator=generator).to(device), mask)
    n = sample_norms(u, "l2")
    return u * _per_sample(init_mag / n.clamp_min(_TINY), u) * _per_sample((n > 0).float(), u)
