"""`z bench serve --compare llama.cpp` without llama.cpp installed (as in CI): the run
still measures zserve and its JSON says how to install the peer; the peer's F32 GGUF
writer on a tiny GGUF (dequantized values, metadata and tokenizer fields copied); bad
options are named. The full comparison needs `make llama-cpp` (see benchmarks/_llamacpp.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.utils.tiny_lm import write_tiny_lm
from zstack.bench import load

Z = str(Path(sys.executable).parent / "z")


def test_compare_without_the_peer_measures_ours_and_names_the_install(tmp_path: Path) -> None:
    lm = write_tiny_lm(tmp_path / "tiny")
    out = subprocess.run(
        [
            Z,
            "bench",
            "serve",
            str(lm),
            "--compare",
            "llama.cpp",
            "--precisions",
            "fp32",
            "--prompt-tokens",
            "8",
            "--decode-tokens",
            "3",
            "--concurrent",
            "2",
            "--repeats",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": ""},  # never the peer's install dir
    )
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["benchmark"] == "serve-compare" and r["peer"]["name"] == "llama.cpp"
    peer = r["peer"]
    if peer["available"] is False and "install" in peer:
        assert "make llama-cpp" in peer["install"]
    else:  # llama-cpp-python importable here: the tiny model is not the GGUF's
        assert "skipped" in peer
    ours = r["rows"]["fp32"]["zserve"]
    assert set(ours) == {"prefill_tok_s", "decode_tok_s", "concurrent_tok_s"}
    assert all(v > 0 for v in ours.values())
    assert "llama.cpp" not in r["rows"]["fp32"]


def test_unknown_precision_and_peer_are_named(tmp_path: Path) -> None:
    compare = load("_serve_compare")
    with pytest.raises(ValueError, match="fp64"):
        compare.check_precisions("fp32,fp64")
    with pytest.raises(ValueError, match="only peer"):
        compare.run_compare(tmp_path, peer="vllm")


def test_f32_gguf_dequantizes_every_tensor_and_copies_metadata(tmp_path: Path) -> None:
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
    from gguf.quants import quantize

    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 64)).astype(np.float32)
    norm = rng.standard_normal(64).astype(np.float32)
    src = tmp_path / "tiny.Q8_0.gguf"
    writer = GGUFWriter(src, "llama")
    writer.add_block_count(1)
    writer.add_file_type(7)
    writer.add_token_list(["<s>", "a", "b"])
    writer.add_tensor(
        "blk.0.attn_q.weight",
        quantize(w, GGMLQuantizationType.Q8_0),  # (4, 68) bytes: 2 blocks of 34 a row
        raw_dtype=GGMLQuantizationType.Q8_0,
    )
    writer.add_tensor("blk.0.attn_norm.weight", norm)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    dst = tmp_path / "tiny.F32.gguf"
    load("_llamacpp").write_f32_gguf(src, dst)
    r = GGUFReader(dst)
    assert r.fields["general.file_type"].contents() == 0
    assert r.fields["llama.block_count"].contents() == 1
    assert r.fields["tokenizer.ggml.tokens"].contents() == ["<s>", "a", "b"]
    got = {t.name: t for t in r.tensors}
    q = got["blk.0.attn_q.weight"]
    assert q.tensor_type == GGMLQuantizationType.F32 and list(q.shape) == [64, 4]
    # Q8_0: one scale per 32 values, so within half a step (max|w| / 127 / 2) per block.
    assert np.abs(np.asarray(q.data).reshape(4, 64) - w).max() <= np.abs(w).max() / 127
    assert np.array_equal(np.asarray(got["blk.0.attn_norm.weight"].data), norm)
