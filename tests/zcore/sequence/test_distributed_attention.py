"""``DistributedAttention`` at cp=2 equals full attention, forward and backward, for uneven
head splits (SmolLM2's 9 query / 3 key-value heads), fewer key/value heads than ranks and a
length not divisible by cp. Tolerance: 1e-5 absolute in fp32 (the same sums, regrouped)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.utils.distributed import run_ranks
from zcore.comm import MeshSpec, job_mesh
from zcore.sequence import DistributedAttention, SequenceParallelError, even_split, head_plan

CASES = [(9, 3, 11), (4, 1, 8), (2, 2, 5), (1, 1, 6)]  # (query heads, kv heads, length)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """(b, S, h, d) attention with as many key/value heads as query heads (or fewer: GQA)."""
    group = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal
    )
    return out.transpose(1, 2)


def _inputs(hq: int, hkv: int, length: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(hq * 100 + length)
    q = torch.randn(2, length, hq, 8, generator=g)
    k = torch.randn(2, length, hkv, 8, generator=g)
    v = torch.randn(2, length, hkv, 8, generator=g)
    w = torch.randn(2, length, hq, 8, generator=g)  # the output's cotangent
    return q, k, v, w


def _reference(hq: int, hkv: int, length: int, causal: bool) -> list[torch.Tensor]:
    q, k, v, w = _inputs(hq, hkv, length)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = _sdpa(q, k, v, causal)
    (out * w).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


def _ranks(rank: int, world: int, causal: bool, mode: str | None = None) -> list:
    """Each case's ``(lo, [out, dq, dk, dv])`` on this rank; ``mode`` as
    :class:`DistributedAttention`'s (``auto`` with ``ring_ok``: its local attention is sdpa)."""
    mesh = job_mesh(MeshSpec.resolve(world, cp=world), 60.0)
    attn = DistributedAttention(
        lambda q, k, v: _sdpa(q, k, v, causal), mode=mode, causal=causal, ring_ok=True
    )
    attn.bind_mesh(mesh)
    results = []
    for hq, hkv, length in CASES:
        lens = even_split(length, world)
        lo = sum(lens[:rank])
        q, k, v, w = (t[:, lo : lo + lens[rank]].clone() for t in _inputs(hq, hkv, length))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = attn(q, k, v, seq_lens=lens)
        (out * w).sum().backward()
        results.append((lo, [out.detach(), q.grad, k.grad, v.grad]))
    return results


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_cp2_equals_full_attention(causal: bool) -> None:
    assert_full_attention(run_ranks(_ranks, 2, args=(causal,)), causal)


def assert_full_attention(per_rank: list, causal: bool) -> None:
    """The ranks' slices of every case, joined, equal one process's attention (1e-5)."""
    for c, (hq, hkv, length) in enumerate(CASES):
        want = _reference(hq, hkv, length, causal)
        got = [torch.cat([r[c][1][i] for r in per_rank], dim=1) for i in range(4)]
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
            torch.testing.assert_close(
                a, b, atol=1e-5, rtol=1e-5, msg=f"{name} {hq}/{hkv}/{length}"
            )


def test_head_plan_splits_unevenly_and_shares_kv_heads() -> None:
    counts, q_ranges, kv_ranges = head_plan(9, 3, 2)
    assert counts == [5, 4] and q_ranges == [(0, 5), (5, 9)]
    assert kv_ranges == [(0, 2), (1, 3)]  # kv head 1 serves query heads 3-5: both ranks get it
    assert head_plan(4, 1, 4)[2] == [(0, 1)] * 4
    with pytest.raises(SequenceParallelError, match="5 query heads cannot share 2"):
        head_plan(5, 2, 2)


def _short(rank: int, world: int) -> str:
    mesh = job_mesh(MeshSpec.resolve(world, cp=world), 60.0)
    attn = DistributedAttention(lambda q, k, v: q, mesh.comm("cp"))
    x = torch.zeros(1, 1 - rank, 2, 4)
    try:
        attn(x, x, x, seq_lens=[1, 0])
        out = "ran"
    except SequenceParallelError as err:
        out = str(err)
    mesh.comm("cp").barrier("refused")  # no rank leaves while a peer still joins a group
    return out


def test_sequence_shorter_than_cp_is_refused() -> None:
    for msg in run_ranks(_short, 2):
        assert "[1, 0]" in msg and "2 cp ranks" in msg and "at least as long" in msg, msg
