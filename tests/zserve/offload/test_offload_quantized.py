"""A `z quantize` directory (W8A8, layers 0-3 quantized as in
`tests/zserve/test_quantized_serving.py`) streams its quantized bytes under a weight budget
and its greedy output equals its resident output, from host memory and from disk.

`slow`: writing the directory runs zquant's quantization of SmolLM2 (~35-45 s here).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import zserve
from tests.utils.models import smollm2_dir

pytestmark = pytest.mark.slow(reason="quantizes SmolLM2 first (~40 s)")

SKIP = ("model.layers.[4-9].*", "model.layers.[12][0-9].*")  # quantize layers 0-3 only
PROMPTS = ["To be, or not to be", "Once more unto the breach"]
ENGINE = {"max_model_len": 64, "num_blocks": 16}


@pytest.fixture(scope="module")
def w8a8_dir(tmp_path_factory) -> Path:
    from zquant.hf import load_model
    from zquant.ptq import quantize
    from zquant.schemes import get_recipe
    from zquant.serialize import save_quantized

    out = tmp_path_factory.mktemp("q") / "smollm2-w8a8"
    spec = get_recipe("w8a8", skip=SKIP)
    model = load_model(smollm2_dir())
    quantize(model, spec)
    return save_quantized(model, out, recipe=spec, source_dir=smollm2_dir())


def generate(pipe: zserve.Pipeline) -> list[list[int]]:
    one = pipe(PROMPTS[:1], max_tokens=6, temperature=0)
    two = pipe(PROMPTS, max_tokens=6, temperature=0)
    return [c.token_ids for c in one + two]


@pytest.mark.parametrize("kind", ["cpu", "nvme"])
def test_quantized_directory_streams_and_matches(w8a8_dir: Path, tmp_path, kind: str) -> None:
    resident = zserve.pipeline(w8a8_dir, **ENGINE)
    want = generate(resident)
    q = resident.engine.runner.model.quantization
    assert q is not None and len(q.served) == 4 * 7
    where = {"offload_dir": str(tmp_path)} if kind == "nvme" else {}
    pipe = zserve.pipeline(w8a8_dir, weights_budget="60M", offload=kind, **where, **ENGINE)
    stream = pipe.engine.runner.model.stream
    assert stream is not None
    plan = stream.plan
    # the quantized layers' blobs are their INT8 codes: about a quarter of an fp32 layer's
    assert plan.layer_bytes[0] < plan.layer_bytes[4] / 3
    assert {0, 1, 2, 3} & set(plan.streamed), plan.streamed
    assert generate(pipe) == want
    stream.close()
