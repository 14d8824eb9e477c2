"""zchat.data: the builder is deterministic and keeps held-out prompts out of training, the
preference rules hold (checked by the task's own program), the labels cover the answer
tokens only, and bad input (no chat template, an empty split) fails naming the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.utils.models import smollm2_dir
from zchat.data import (
    IGNORE,
    ChatTemplateError,
    EmptyDatasetError,
    answer_batch,
    build_chat_data,
    check_sum,
    load_tokenizer,
    operands_of,
    require_nonempty,
)
from zchat.data.shakespeare import spoken_lines


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return load_tokenizer(smollm2_dir())


def test_arithmetic_is_deterministic_disjoint_and_follows_its_rule() -> None:
    data = build_chat_data("arithmetic", train=300, heldout=100, seed=3)
    assert data == build_chat_data("arithmetic", train=300, heldout=100, seed=3)
    assert data != build_chat_data("arithmetic", train=300, heldout=100, seed=4)
    assert data.sizes() == dict.fromkeys(data.sizes(), 300) | {
        k: 100 for k in data.sizes() if k.endswith("heldout")
    }
    train = {operands_of(p.messages) for p in data.pairs_train}
    held = {operands_of(p.messages) for p in data.pairs_heldout}
    assert len(train) == 300 and len(held) == 100 and not train & held
    for pair in data.pairs_train + data.pairs_heldout:
        a, b = operands_of(pair.messages)
        assert check_sum(pair.chosen, a, b) and not check_sum(pair.rejected, a, b)
        assert pair.chosen[-1] != pair.rejected[-1]  # |d| <= 9: the last digit differs
    for prompt, example in zip(data.prompts_heldout, data.sft_heldout, strict=True):
        assert prompt.messages == example.messages and prompt.reference == example.answer


def test_shakespeare_pairs_prefer_the_real_next_line() -> None:
    from ztrain.data import load_plays, split_plays

    train_plays, held_plays = split_plays(load_plays())
    data = build_chat_data(
        "shakespeare",
        train=20,
        heldout=10,
        seed=0,
        train_plays=train_plays,
        heldout_plays=held_plays,
    )
    texts = {title: text for title, text in train_plays + held_plays}
    held_titles = {t for t, _ in held_plays}
    for pair, split in [(p, "train") for p in data.pairs_train] + [
        (p, "heldout") for p in data.pairs_heldout
    ]:
        prompt = pair.messages[0]["content"]
        title = next(t for t in texts if f"from {t} with" in prompt)
        assert (title in held_titles) == (split == "heldout")
        window = [*prompt.split("\n\n", 1)[1].split("\n"), pair.chosen]
        # chosen: the spoken line right after the shown ones in that play (speaker names and
        # stage directions between them skipped); rejected: a line from another play
        lines = spoken_lines(texts[title])
        assert any(lines[i : i + 3] == window for i in range(len(lines)))
        assert pair.rejected not in texts[title]


def test_labels_cover_only_the_answer(tokenizer) -> None:  # type: ignore[no-untyped-def]
    data = build_chat_data("arithmetic", train=4, heldout=0, seed=0)
    batch = answer_batch(tokenizer, [(e.messages, e.answer) for e in data.sft_train])
    for i, example in enumerate(data.sft_train):
        labels = batch["labels"][i]
        kept = batch["input_ids"][i][labels != IGNORE]
        # the answer and the template's end of turn, nothing of the prompt
        assert tokenizer.decode(kept) == f"{example.answer}<|im_end|>"
        n = int(batch["attention_mask"][i].sum())
        assert (labels[n:] == IGNORE).all()  # padding carries no loss
        first = int((labels != IGNORE).nonzero()[0])
        assert tokenizer.decode(batch["input_ids"][i][:first]).endswith("<|im_start|>assistant\n")


def test_model_without_chat_template_fails_naming_the_fix(tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((smollm2_dir() / name).read_text())
    cfg = (tmp_path / "tokenizer_config.json").read_text()
    assert "chat_template" not in cfg  # SmolLM2 keeps its template in chat_template.jinja
    with pytest.raises(ChatTemplateError, match=rf"`{tmp_path}` has no chat template.*Instruct"):
        load_tokenizer(tmp_path)


def test_empty_split_fails_naming_it() -> None:
    data = build_chat_data("arithmetic", train=0, heldout=2)
    with pytest.raises(EmptyDatasetError, match="`pairs_train` split is empty; raise"):
        require_nonempty(data.pairs_train, "pairs_train", "raise `--train`")
    with pytest.raises(ValueError, match="only 4 pairs"):
        build_chat_data("arithmetic", train=4, heldout=1, low=1, high=2)
    with pytest.raises(ValueError, match="unknown task `poems`"):
        build_chat_data("poems")
