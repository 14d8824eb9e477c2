"""The runner's forward on znative's kernels (zserve.model.native) against the same runner
on the torch ops they replace, on a tiny random LLaMA, fp32 and bf16: a ragged batch with
a prompt chunk, a chunk continuing a cached prompt and decodes, then greedy decoding
against transformers' `generate` (fp32).

RMSNorm is bit-identical to its torch reference (the kernel adds the squares in torch's
order: a W8A8 model's INT8 activation codes, hence its perplexity, depend on those bits).
Tolerance of the forward: fp32 logits within 1e-4 (decode attention sums its products in
another order); bf16 within 0.1 of logits of magnitude ~5, i.e. a few bf16
ulps of the hidden states after two layers (both paths round to bf16 at every op)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from tests.zserve.tiny_llama import hf_greedy, tiny_llama
from zserve.model import llama, native
from zserve.model.attention import ragged_paged_attention
from zserve.runner import ModelRunner, SeqChunk


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-native")
    tiny_llama(out)
    return out


def _runner(model_dir: Path, dtype: torch.dtype, native: bool) -> ModelRunner:
    r = ModelRunner(model_dir, num_blocks=32, block_size=4, dtype=dtype)
    assert r.model.native, "CPU fp32/bf16 must run the native kernels"
    if not native:
        r.model.native = False
        r.attention = ragged_paged_attention
    return r


def _batches() -> list[list[SeqChunk]]:
    a, b, c = list(range(3, 14)), list(range(20, 26)), list(range(40, 49))
    return [
        [SeqChunk(0, a[:7], 0, [5, 2]), SeqChunk(1, b, 0, [7, 8])],
        # a continues from position 7; b and c decode; c's prompt arrives whole.
        [
            SeqChunk(0, a[7:], 7, [5, 2, 9]),
            SeqChunk(1, [b[-1]], 6, [7, 8]),
            SeqChunk(2, c, 0, [11, 12, 13]),
        ],
        [
            SeqChunk(0, [1], 11, [5, 2, 9]),
            SeqChunk(1, [2], 7, [7, 8]),
            SeqChunk(2, [3], 9, [11, 12, 13]),
        ],
    ]


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
def test_native_forward_matches_torch_ops(model_dir: Path, dtype: torch.dtype, atol: float) -> None:
    fast, ref = _runner(model_dir, dtype, True), _runner(model_dir, dtype, False)
    for chunks in _batches():
        got, want = fast.forward(chunks), ref.forward(chunks)
        torch.testing.assert_close(got, want, rtol=0, atol=atol)
    torch.testing.assert_close(
        fast.kv_cache._storage.float(), ref.kv_cache._storage.float(), rtol=0, atol=atol
    )


def test_native_greedy_matches_transformers(model_dir: Path) -> None:
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    runner = _runner(model_dir, torch.float32, True)
    prompt = [5, 9, 17, 33, 2, 70, 101, 4]
    want = hf_greedy(hf, prompt, 12)
    table = list(range(8))
    tokens: list[int] = []
    logits = runner.forward([SeqChunk(0, prompt, 0, table)])
    for step in range(len(want)):
        tokens.append(int(logits.argmax(-1)))
        logits = runner.forward([SeqChunk(0, [tokens[-1]], len(prompt) + step, table)])
    assert tokens == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_rms_norm_is_bit_identical(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    # below one 8-lane vector (torch's scalar sum), around it, and model widths up to 8192
    for hidden in (1, 5, 7, 8, 9, 40, 576, 1000, 2048, 4099, 8192):
        x = (torch.randn(17, hidden) * torch.rand(17, 1) * 10).to(dtype)
        w = (torch.rand(hidden) + 0.5).to(dtype)
        got, want = native.rms_norm(x, w, 1e-5), llama.rms_norm(x, w, 1e-5)
        assert torch.equal(got, want), (hidden, (got.float() - want.float()).abs().max())


def test_native_linear_matches_f_linear() -> None:
    """Decode rows through znative.linear_rows vs F.linear: both accumulate in f32 (bf16
    rounded once), in another order, so within 2 bf16 ulps (rtol 2 * 2^-8) and fp32 within
    1e-5; more rows, a bias or a module weight go to torch / the module as they are."""
    torch.manual_seed(0)
    w = torch.randn(1000, 576).bfloat16()
    for rows in (0, 1, 3, native.LINEAR_MAX_ROWS, native.LINEAR_MAX_ROWS + 1):
        x = torch.randn(rows, 576).bfloat16()
        got, want = native.lm_head(x, w), torch.nn.functional.linear(x, w)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 1000)
        torch.testing.assert_close(got.float(), want.float(), rtol=2 * 2**-8, atol=1e-2)
        x32, w32 = x.float(), w.float()
        got32 = native.linear(x32, w32)
        assert got32.dtype == torch.float32 and got32.shape == (rows, 1000)
        torch.testing.assert_close(got32, F.linear(x32, w32), rtol=1e-5, atol=1e-4)
    x32, bias = torch.randn(2, 576), torch.randn(1000)
    assert torch.equal(native.linear(x32, w.float(), bias), F.linear(x32, w.float(), bias))
    assert torch.equal(native.linear(x32, lambda t: t * 2), x32 * 2)


def test_pack_on_huge_pages_moves_tensors_into_one_buffer() -> None:
    """Contiguous CPU tensors move, in slot order, into one buffer, bit-identical and 64-byte
    aligned; a module or a strided view stays as it was."""

    class Slots:
        pass

    torch.manual_seed(0)
    s = Slots()
    s.a, s.b, s.c = torch.randn(7, 5), torch.randn(3, 33).bfloat16(), torch.randn(300, 64)
    s.strided, s.module = torch.randn(4, 6).t(), torch.nn.Identity()
    before = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in vars(s).items()}
    strided, module = s.strided, s.module
    native.pack_on_huge_pages([(s, n) for n in ("a", "b", "strided", "module", "c")])
    for name in ("a", "b", "c"):
        got, want = getattr(s, name), before[name]
        assert got.dtype == want.dtype and torch.equal(got, want), name
        assert got.data_ptr() % native.TENSOR_ALIGN == 0
    assert s.a.data_ptr() % native.HUGE_PAGE == 0  # the buffer starts on a huge page
    assert s.a.data_ptr() + 192 == s.b.data_ptr()  # 140 bytes rounded up to 64
    assert s.b.data_ptr() + 256 == s.c.data_ptr()  # 198 bytes rounded up to 64
    assert s.strided is strided and s.module is module


def test_directory_model_weights_are_packed(tmp_path: Path) -> None:
    """A model read from a directory has its projections and head in one buffer in the order
    a forward reads them, a tied head staying the embedding table, and the logits of the
    unpacked weights (the same weights handed over in memory, which are not packed: zchat's
    shared weights); untied, test_runner_weights compares the two."""
    tiny_llama(tmp_path, tie_word_embeddings=True)
    r = ModelRunner(tmp_path, num_blocks=8, block_size=4)
    m = r.model
    order = [w for layer in m.layers for w in (layer.qkv, layer.o, layer.mlp.gate_up)]
    order += [m.layers[-1].mlp.down, m.lm_head]
    assert order[0].data_ptr() % native.HUGE_PAGE == 0
    assert all(a.data_ptr() < b.data_ptr() for a, b in itertools.pairwise(order))
    assert m.lm_head is m.embed
    weights = load_file(str(tmp_path / "model.safetensors"))
    handed = ModelRunner(tmp_path, num_blocks=8, block_size=4, weights=weights)
    assert handed.model.embed.data_ptr() == weights["model.embed_tokens.weight"].data_ptr()
    chunks = [SeqChunk(0, [3, 9, 27, 81], 0, [0]), SeqChunk(1, [5, 7], 0, [1])]
    torch.testing.assert_close(r.forward(chunks), handed.forward(chunks), rtol=0, atol=0)


def test_host_views_follow_a_new_kv_cache(model_dir: Path) -> None:
    """The numpy views a forward takes once (native.HostViews) are retaken when a slot holds
    another tensor: a runner given a fresh KV cache between forwards writes to the new cache
    and gives the logits of a runner that had it from the start; an array passed where a
    tensor was is used as it is."""
    from zserve.kv_cache import KVCache

    views = native.HostViews()
    t = torch.ones(4, dtype=torch.bfloat16)
    first = views("w", t)
    assert first.dtype.name == "int16" and views("w", t) is first
    assert native.np_view(first) is first
    other = torch.ones(4, dtype=torch.bfloat16)
    assert views("w", other) is not first  # same slot, another tensor: a new view

    batches = _batches()
    fast, ref = _runner(model_dir, torch.float32, True), _runner(model_dir, torch.float32, True)
    fast.forward(batches[0])  # views of the first cache taken
    old = fast.kv_cache
    fast.kv_cache = KVCache(
        num_layers=old.num_layers,
        num_blocks=old.num_blocks,
        block_size=old.block_size,
        num_kv_heads=old.num_kv_heads,
        head_dim=old.head_dim,
        dtype=old.dtype,
        device=old.device,
    )
    saved = old._storage.clone()
    for chunks in batches:
        got, want = fast.forward(chunks), ref.forward(chunks)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(old._storage, saved)  # the old cache was not written
    assert torch.equal(fast.kv_cache._storage, ref.kv_cache._storage)
