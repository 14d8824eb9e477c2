"""Greedy output of SmolLM2 served under a weight budget equals the resident model's, token
for token: layers streamed from host memory (`cpu`) and from a swap file read with O_DIRECT
(`nvme`, on the tmp directory's filesystem), at budgets of 1/2 and 1/4 of the decoder-layer
weights. The prompts run one alone (batch-1 decodes on the decode program) and five together
(decodes of five rows on the per-op path); prompt chunks always take the per-op path.

The default suite runs the 1/4 budget from disk (the issue's target) and 1/2 from host
memory; the two other corners are `slow`.
"""

from __future__ import annotations

import pytest

import zserve
from tests.utils.models import smollm2_dir

pytestmark = pytest.mark.heavy(40)

PROMPTS = [
    "To be, or not to be",
    "Once more unto the breach",
    "The quality of mercy",
    "Friends, Romans, countrymen",
    "All the world's a stage",
]
TOKENS = 4
ENGINE = {"max_model_len": 64, "num_blocks": 32}
LAYER_WEIGHTS = 30 * 3_538_944 * 4  # SmolLM2's 30 decoder layers, fp32 (norms aside)


def generate(pipe: zserve.Pipeline) -> list[list[int]]:
    one = pipe(PROMPTS[:1], max_tokens=TOKENS, temperature=0)
    five = pipe(PROMPTS, max_tokens=TOKENS, temperature=0)
    return [c.token_ids for c in one + five]


@pytest.fixture(scope="module")
def resident() -> list[list[int]]:
    return generate(zserve.pipeline(smollm2_dir(), **ENGINE))


@pytest.mark.parametrize(
    ("kind", "fraction"),
    [
        ("nvme", 4),
        ("cpu", 2),
        pytest.param("nvme", 2, marks=pytest.mark.slow(reason="the other budget from disk")),
        pytest.param("cpu", 4, marks=pytest.mark.slow(reason="the other budget from memory")),
    ],
)
def test_greedy_output_equals_resident(
    resident: list[list[int]], tmp_path, kind: str, fraction: int
) -> None:
    where = {"offload_dir": str(tmp_path)} if kind == "nvme" else {}
    budget = LAYER_WEIGHTS // fraction
    pipe = zserve.pipeline(smollm2_dir(), weights_budget=budget, offload=kind, **where, **ENGINE)
    stream = pipe.engine.runner.model.stream
    assert stream is not None
    assert generate(pipe) == resident
    stats = stream.stats()
    assert stats["held_bytes"] <= budget, stats
    assert stats["streamed_layers"] >= 30 - 30 // fraction, stats
    assert stats["fetches"] > stats["streamed_layers"] * TOKENS, stats
    if kind == "nvme":
        io = stream.store.stats()  # type: ignore[attr-defined]
        assert io["direct"] > 0 and io["direct_refused"] == 0, io
        swap = list(tmp_path.glob("zserve-offload-*/layers.swp"))
        assert len(swap) == 1 and swap[0].stat().st_size >= LAYER_WEIGHTS
    stream.close()
