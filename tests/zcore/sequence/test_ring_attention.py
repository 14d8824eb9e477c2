"""Ring attention (``DistributedAttention(mode="ring")``) equals full attention in one
process, forward and backward (grads of q, k and v), causal and not, with grouped-query
attention, lengths not divisible by cp, more ranks than heads (Ulysses' cap), and the
zig-zag layout; tiles by torch's CPU flash kernel and (cp=2) by the written-out reference
arithmetic. Inputs are float64 but the ring computes in float32: tolerance 2e-5 absolute and
relative (float32 summation order, online-softmax merge)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.utils.distributed import run_ranks
from zcore.comm import MeshSpec, job_mesh
from zcore.sequence import DistributedAttention, SequenceParallelError, even_split
from zcore.sequence.ring import RingLayout, ring_attention
from zcore.sequence.ring_blocks import tiles

# (query heads, kv heads, length): GQA 4/2, MQA 3/1 (cp above the heads at cp=4),
# SmolLM2's 9/3, a length of exactly cp, and one cp does not divide.
CASES = [(4, 2, 11), (3, 1, 9), (9, 3, 7), (1, 1, 4), (2, 2, 13)]
TOL = {"atol": 2e-5, "rtol": 2e-5}


def _inputs(hq: int, hkv: int, length: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(hq * 100 + length)
    shapes = [(2, length, h, 8) for h in (hq, hkv, hkv, hq)]  # q, k, v, output cotangent
    return tuple(torch.randn(s, generator=g, dtype=torch.float64) for s in shapes)


def _reference(hq: int, hkv: int, length: int, causal: bool) -> list[torch.Tensor]:
    q, k, v, w = _inputs(hq, hkv, length)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    group = hq // hkv
    kk, vv = (t.repeat_interleave(group, dim=2).transpose(1, 2) for t in (k, v))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), kk, vv, is_causal=causal)
    out = out.transpose(1, 2)
    (out * w).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


def _layout(kind: str, length: int, cp: int) -> RingLayout:
    if kind == "zigzag":
        return RingLayout.zigzag(length, cp)
    return RingLayout.consecutive(even_split(length, cp))


def _ranks(rank: int, world: int, causal: bool, kind: str, reference: bool) -> list:
    mesh = job_mesh(MeshSpec.resolve(world, cp=world), 60.0)
    attn = DistributedAttention(lambda *a: None, mode="ring", causal=causal)
    attn.bind_mesh(mesh)
    results = []
    for hq, hkv, length in CASES:
        layout = _layout(kind, length, world)
        mine = layout.index(rank)
        q, k, v, w = (t[:, mine].clone() for t in _inputs(hq, hkv, length))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        if reference:  # the written-out tile arithmetic instead of torch's CPU flash kernel
            out = ring_attention(q, k, v, mesh.comm("cp"), layout, causal=causal, reference=True)
        else:
            out = attn(q, k, v, layout=layout)
        (out * w).sum().backward()
        results.append([out.detach(), q.grad, k.grad, v.grad])
    return results


def _check(world: int, causal: bool, kind: str, reference: bool = False) -> None:
    per_rank = run_ranks(_ranks, world, args=(causal, kind, reference))
    for c, (hq, hkv, length) in enumerate(CASES):
        want = _reference(hq, hkv, length, causal)
        layout = _layout(kind, length, world)
        for i, name in enumerate(("out", "dq", "dk", "dv")):
            got = torch.empty_like(want[i])
            for r in range(world):
                got[:, layout.index(r)] = per_rank[r][c][i].to(got.dtype)
            torch.testing.assert_close(got, want[i], **TOL, msg=f"{name} {hq}/{hkv}/{length}")


@pytest.mark.parametrize("reference", [False, True], ids=["flash", "reference"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_ring_cp2_equals_full_attention(causal: bool, reference: bool) -> None:
    _check(2, causal, "consecutive", reference)


@pytest.mark.parametrize("kind", ["consecutive", "zigzag"])
def test_ring_cp3_causal_equals_full_attention(kind: str) -> None:
    _check(3, True, kind)


@pytest.mark.slow(reason="4 gloo ranks, 4 layout x mask cases: ~3 s each, 4 processes")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("kind", ["consecutive", "zigzag"])
def test_ring_cp4_equals_full_attention(kind: str, causal: bool) -> None:
    """cp 4 above 3/1 heads (Ulysses would leave ranks without heads; the ring splits none)."""
    _check(4, causal, kind)


def test_zigzag_balances_causal_work() -> None:
    layout = RingLayout.zigzag(16, 4)
    assert layout.runs == (
        ((0, 2), (14, 16)),
        ((2, 4), (12, 14)),
        ((4, 6), (10, 12)),
        ((6, 8), (8, 10)),
    )
    assert layout.lens == [4, 4, 4, 4]
    assert RingLayout.zigzag(5, 2).lens == [3, 2]  # chunks 2,1,1,1: every rank >= 1 token
    assert layout.index(1).tolist() == [2, 3, 12, 13]
    # query x key positions each rank computes at each ring step (diagonal blocks in full):
    # zig-zag gives every rank the same work; with consecutive slices the last does cp x more
    work = {
        kind: [
            [sum((t.qb - t.qa) * (t.kb - t.ka) for t in tiles(q, k, True)) for k in lay.runs]
            for q in lay.runs
        ]
        for kind, lay in (("zigzag", layout), ("consecutive", _layout("consecutive", 16, 4)))
    }
    assert work["zigzag"] == [[12, 8, 8, 8], [8, 12, 8, 8], [8, 8, 12, 8], [8, 8, 8, 12]]
    assert work["consecutive"] == [[16, 0, 0, 0], [16, 16, 0, 0], [16, 16, 16, 0], [16] * 4]


def test_ring_mode_refusals() -> None:
    with pytest.raises(SequenceParallelError, match="mode 'rings' is not one of"):
        DistributedAttention(lambda *a: None, mode="rings")
    from zcore.comm import Comm

    attn = DistributedAttention(lambda *a: None, Comm(None, 0, 1, 5.0), mode="ring")
    x = torch.zeros(1, 4, 2, 8)
    with pytest.raises(SequenceParallelError, match=r"no dropout.*dropout 0.1"):
        attn(x, x, x, dropout_p=0.1)
    with pytest.raises(SequenceParallelError, match=r"\[3\] positions per rank.*4 tokens"):
        attn(x, x, x, layout=RingLayout.consecutive([3]), seq_lens=[4])
