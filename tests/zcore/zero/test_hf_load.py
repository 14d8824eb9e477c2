"""zcore.hf on one process: its safetensors reader and writer against the safetensors library,
and bad input (no weights, a damaged file, names or shapes that do not match) failing with
an error that names the problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.zserve.tiny_llama import tiny_llama
from zcore.hf import CheckpointFormatError, CheckpointKeyError, from_pretrained, save_pretrained
from zcore.hf.safetensors_io import Checkpoint, Spec, Writer, write_order


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny")
    tiny_llama(out)
    return out


def test_writer_and_reader_agree_with_the_safetensors_library(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(0)
    tensors = {
        "a.weight": torch.randn(5, 7, generator=g),
        "b.bf16": torch.randn(3, 4, generator=g).to(torch.bfloat16),
        "c.ids": torch.arange(6, dtype=torch.int64).view(2, 3),
        "d.mask": torch.tensor([True, False, True]),
        "e.scalar": torch.tensor(2.5),
    }
    specs = write_order([Spec(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()])
    ours = tmp_path / "model.safetensors"
    with open(ours, "wb") as f:
        w = Writer(f, specs, {"format": "pt"})
        for s in specs:
            w.write(s.name, tensors[s.name])
        w.close()
    back = load_file(ours)
    assert set(back) == set(tensors)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    # the reader, on a file the library wrote: exact element ranges, exact byte count
    theirs = tmp_path / "lib"
    theirs.mkdir()
    save_file(tensors, theirs / "model.safetensors")
    ckpt = Checkpoint(theirs)
    assert torch.equal(ckpt.read("a.weight", 9, 30), tensors["a.weight"].view(-1)[9:30])
    assert torch.equal(ckpt.read("b.bf16", 0, 5), tensors["b.bf16"].view(-1)[:5])
    assert ckpt.bytes_read == 21 * 4 + 5 * 2
    assert torch.equal(ckpt.read("d.mask"), tensors["d.mask"])
    ckpt.close()


def test_a_directory_without_weights_names_itself_and_the_fix(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    from transformers import LlamaForCausalLM

    with pytest.raises(CheckpointFormatError, match=r"no `model.safetensors`.*config.json"):
        from_pretrained(LlamaForCausalLM, tmp_path)


def test_a_truncated_file_is_refused(tmp_path: Path, tiny: Path) -> None:
    raw = (tiny / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CheckpointFormatError, match="damaged or truncated"):
        Checkpoint(tmp_path)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"num_hidden_layers": 3}, r"missing from the checkpoint: `model\.layers\.2\."),
        ({"num_hidden_layers": 1}, r"in the checkpoint but not the model: `model\.layers\.1\."),
        ({"intermediate_size": 80}, r"shape mismatch: `model\.layers\.0\.mlp\.\w+_proj\.weight`"),
        ({"tie_word_embeddings": True, "vocab_size": 100}, r"\[128, 64\] in the checkpoint"),
    ],
)
def test_names_or_shapes_that_do_not_match_are_named(
    tiny: Path, overrides: dict, needle: str
) -> None:
    from transformers import LlamaForCausalLM

    with pytest.raises(CheckpointKeyError, match=needle):
        from_pretrained(LlamaForCausalLM, tiny, **overrides)


def test_not_strict_skips_and_lists_unexpected_tensors(tiny: Path) -> None:
    from transformers import LlamaForCausalLM

    model = from_pretrained(LlamaForCausalLM, tiny, strict=False, num_hidden_layers=1)
    ignored = model.z_load_report.ignored
    assert ignored and all(k.startswith("model.layers.1.") for k in ignored)


def test_an_auto_class_needs_its_config(tiny: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

    with pytest.raises(TypeError, match=r"config=AutoConfig\.from_pretrained"):
        from_pretrained(AutoModelForCausalLM, tiny)
    model = from_pretrained(AutoModelForCausalLM, tiny, config=AutoConfig.from_pretrained(tiny))
    ref = LlamaForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    for (name, p), q in zip(ref.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_save_of_a_plain_model_round_trips_through_transformers(tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    src = tmp_path / "src"
    ref = tiny_llama(src, tie_word_embeddings=True)
    model = from_pretrained(LlamaForCausalLM, src)  # no process group: one rank, no ZeRO
    out = save_pretrained(model, tmp_path / "out", dtype=torch.bfloat16)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    back = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert back.lm_head.weight is back.model.embed_tokens.weight
    for (name, p), q in zip(ref.named_parameters(), back.parameters(), strict=True):
        assert torch.equal(p.to(torch.bfloat16).float(), q), name
    # saving again replaces the directory whole; nothing temporary is left beside it
    save_pretrained(model, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


def test_the_clipping_norm_is_accurate_on_a_large_partition() -> None:
    """SmolLM2's 67M-element partitions on 2 ranks: the fp32 sum of squares that gradient
    clipping divides by must not drift (a one-pass fp32 ``vector_norm`` is 1% low there)."""
    from zcore.zero.store import sq_norm

    t = torch.randn(20_000_003, generator=torch.Generator().manual_seed(0)) * 1e-3
    exact = float(t.double().pow(2).sum())
    assert sq_norm(t) == pytest.approx(exact, rel=1e-6)
    assert sq_norm(t[:1000]) == pytest.approx(float(t[:1000].double().pow(2).sum()), rel=1e-6)
