from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ztrain.generate import export_dir, generate, load_for_generation
from ztrain.gpt import GPT, GPTConfig
from ztrain.tokenizer import Tokenizer

PROMPT = "ROMEO:\nBut soft, what light"


@pytest.fixture
def model(tokenizer: Tokenizer) -> GPT:
    return GPT(GPTConfig.preset("tiny", vocab_size=tokenizer.vocab_size, n_layer=2), seed=3)


def test_sampling_is_reproducible_with_a_seed(model: GPT, tokenizer: Tokenizer) -> None:
    a = generate(model, tokenizer, PROMPT, 20, seed=7)
    assert a == generate(model, tokenizer, PROMPT, 20, seed=7)
    assert a.startswith(PROMPT) and len(tokenizer.encode(a)) > len(tokenizer.encode(PROMPT))
    others = {generate(model, tokenizer, PROMPT, 20, seed=s) for s in range(1, 4)}
    assert others - {a}
    assert model.training  # restored


def test_greedy_is_argmax(model: GPT, tokenizer: Tokenizer) -> None:
    out = generate(model, tokenizer, PROMPT, 8, temperature=0.0)
    ids = tokenizer.encode(PROMPT)
    model.eval()
    with torch.no_grad():
        for _ in range(8):
            logits, _ = model(torch.tensor([ids]))
            ids.append(int(logits[0, -1].argmax()))
    assert out == tokenizer.decode(ids)
    assert out == generate(model, tokenizer, PROMPT, 8, temperature=0.0, seed=1)


def test_top_k_one_is_greedy(model: GPT, tokenizer: Tokenizer) -> None:
    greedy = generate(model, tokenizer, PROMPT, 6, temperature=0.0)
    assert generate(model, tokenizer, PROMPT, 6, temperature=1.3, top_k=1, seed=0) == greedy


def test_long_prompts_are_cropped_and_empty_prompts_work(
    model: GPT, tokenizer: Tokenizer, plays: list[tuple[str, str]]
) -> None:
    long_prompt = dict(plays)["Hamlet"][:3000]
    assert len(tokenizer.encode(long_prompt)) > model.config.block_size
    assert generate(model, tokenizer, long_prompt, 4, seed=0).startswith(long_prompt)
    assert len(tokenizer.encode(generate(model, tokenizer, "", 5, seed=0))) >= 1
    with pytest.raises(ValueError, match="temperature must be >= 0, got -1"):
        generate(model, tokenizer, PROMPT, 1, temperature=-1)


@pytest.mark.parametrize("tie", [True, False])
def test_export_round_trip_gives_identical_logits(
    tokenizer: Tokenizer, tmp_path: Path, tie: bool
) -> None:
    config = GPTConfig.preset("tiny", vocab_size=tokenizer.vocab_size, tie_weights=tie)
    model = GPT(config, seed=5)
    with torch.no_grad():  # make the head differ from a fresh init
        model.lm_head.weight.mul_(1.5)
    out = export_dir(model.state_dict(), config, tokenizer, tmp_path / "export")
    assert sorted(p.name for p in out.iterdir()) == [
        "model.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    assert json.loads((out / "model.json").read_text()) == config.to_dict()
    assert [p.name for p in tmp_path.iterdir()] == ["export"]  # no temp dirs left

    loaded, loaded_tok = load_for_generation(out)
    assert not loaded.training
    assert loaded.config == config
    assert loaded_tok.to_str() == tokenizer.to_str()
    if tie:
        assert loaded.lm_head.weight is loaded.transformer.wte.weight
    idx = torch.tensor([tokenizer.encode(PROMPT)])
    model.eval()
    with torch.no_grad():
        assert torch.equal(loaded(idx)[0], model(idx)[0])


def test_export_replaces_an_existing_dir_and_loads_pt(tokenizer: Tokenizer, tmp_path: Path) -> None:
    config = GPTConfig.preset("tiny", vocab_size=tokenizer.vocab_size, n_layer=1)
    first, second = GPT(config, seed=1), GPT(config, seed=2)
    export_dir(first.state_dict(), config, tokenizer, tmp_path / "export")
    out = export_dir(second.state_dict(), config, tokenizer, tmp_path / "export")
    assert [p.name for p in tmp_path.iterdir()] == ["export"]
    loaded, _ = load_for_generation(out / "model.safetensors")
    assert torch.equal(loaded.transformer.wte.weight, second.transformer.wte.weight)

    torch.save(first.state_dict(), out / "weights.pt")
    from_pt, _ = load_for_generation(out / "weights.pt")
    for (name, a), b in zip(from_pt.state_dict().items(), first.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_missing_sidecars_are_named(tokenizer: Tokenizer, tmp_path: Path) -> None:
    config = GPTConfig.preset("tiny", vocab_size=tokenizer.vocab_size, n_layer=1)
    torch.save(GPT(config).state_dict(), tmp_path / "w.pt")
    with pytest.raises(FileNotFoundError, match=r"lacks model\.json, tokenizer\.json"):
        load_for_generation(tmp_path / "w.pt")
