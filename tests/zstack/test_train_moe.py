"""`z train --moe` end to end: a 2-rank expert-parallel run, its metrics, its Mixtral export.

One real run (2 gloo ranks through the launcher, `--moe-ep 2`: each rank holds 2 of the 4
experts of every layer, ZeRO stage 3) is shared by the module. Its checkpoint exported by
`z export-mixtral` must give transformers' `MixtralForCausalLM` our model's logits on
held-out Shakespeare (fp32, max |diff| <= 1e-4 x max(1, max |logit|), as zserve's Mixtral
tests), and zserve's greedy decoding of it must be transformers' `generate(do_sample=False)`
token for token.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from transformers import MixtralForCausalLM

from tests.zserve.tiny_llama import hf_greedy
from tests.zstack.test_train import TINY, invoke, z_train
from zserve.pipelines import pipeline
from zstack.cmd_train import _load_model
from ztrain.data import ShakespeareData, load_plays
from ztrain.metrics import read_jsonl
from ztrain.moe_lm import MoELM
from ztrain.train_options import TrainError, TrainOptions, cache_dir
from ztrain.train_plan import plan_run

# About 40 s in all on a quiet 2-core machine: the xdist workers start this file first.
pytestmark = pytest.mark.heavy(40)

MOE = ["--moe", "--moe-experts", "4", "--moe-top-k", "2", "--moe-dropless", "--moe-ep", "2"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("zstack-cache")


@pytest.fixture(autouse=True)
def _cache_env(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZSTACK_CACHE", str(cache))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, cache: Path) -> Path:
    """A finished 4-step, 2-rank, ep=2 ZeRO-3 run of the tiny MoE, saved at the end."""
    out = tmp_path_factory.mktemp("run") / "moe"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ZSTACK_CACHE", str(cache))
        done = z_train("--nproc", "2", "--steps", "4", *TINY, *MOE, "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "MoE tiny" in done.stdout and "ep 2" in done.stdout, done.stdout
    return out


@pytest.fixture(scope="module")
def mixtral(run: Path) -> Path:
    out = run.parent / "mixtral"
    code, text = invoke("export-mixtral", str(run), str(out))
    assert code == 0, text
    assert "Mixtral, 4 layers x 4 experts, top-2" in text
    return out


@pytest.fixture(scope="module")
def text_ids(run: Path) -> torch.Tensor:
    """(2, 64) windows of the held-out plays, in the run's tokenizer."""
    _, tokenizer = _load_model(run / "checkpoints")
    data = ShakespeareData.load(tokenizer, cache_dir(), load_plays())
    return data.stream("val", 64).get_micro_batch(0, 0, 0, 1, 2)[0]


def test_metrics_have_aux_loss_drops_and_expert_load(run: Path) -> None:
    records = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    for r in records[1:]:
        assert 0.5 < r["aux_loss"] < 4 and r["dropped_fraction"] == 0.0  # dropless
        assert len(r["expert_load"]) == 4 and all(len(layer) == 4 for layer in r["expert_load"])
        assert all(math.isclose(sum(layer), 1.0, abs_tol=1e-3) for layer in r["expert_load"])
    assert records[-1]["val_loss"] < records[0]["val_loss"]
    model_json = json.loads((run / "checkpoints" / "model.json").read_text())
    assert model_json["arch"] == "mixtral" and model_json["ep_size"] == 2


def test_transformers_logits_equal_ours(run: Path, mixtral: Path, text_ids: torch.Tensor) -> None:
    ours, _ = _load_model(run / "checkpoints")  # consolidated over the ep=2 rank files
    assert isinstance(ours, MoELM) and ours.config.ep_size == 1
    exported, _ = _load_model(run)  # the run's own `export/`
    hf = MixtralForCausalLM.from_pretrained(mixtral).eval()
    with torch.no_grad():
        ref = hf(text_ids).logits
        for model, what in ((ours, "checkpoint"), (exported, "export/")):
            diff = (model(text_ids)[0] - ref).abs().max().item()
            assert diff <= 1e-4 * max(1.0, ref.abs().max().item()), f"{what}: {diff:.2e}"


def test_zserve_greedy_equals_transformers_generate(mixtral: Path, text_ids: torch.Tensor) -> None:
    hf = MixtralForCausalLM.from_pretrained(mixtral).eval()
    prompts = [text_ids[0, :20].tolist(), text_ids[1, :7].tolist()]
    got = pipeline(mixtral, num_blocks=64)(prompts, max_tokens=10, temperature=0)
    for ids, completion in zip(prompts, got, strict=True):
        assert completion.token_ids == hf_greedy(hf, ids, 10), f"prompt of {len(ids)} tokens"


@pytest.mark.slow
def test_capacity_run_reports_dropped_tokens(tmp_path: Path) -> None:
    out = tmp_path / "capacity"
    code, text = invoke(
        "train",
        "--nproc",
        "1",
        "--steps",
        "2",
        *TINY,
        "--moe",
        "--moe-experts",
        "4",
        "--moe-capacity-factor",
        "0.5",
        "--out",
        str(out),
    )
    assert code == 0, text
    assert "capacity factor 0.5" in text and "dropped " in text
    last = read_jsonl(out / "metrics.jsonl")[-1]
    assert 0.2 < last["dropped_fraction"] < 1.0, last


def test_export_refuses_a_gpt_run_and_a_missing_run(tmp_path: Path) -> None:
    ckpt = tmp_path / "gpt" / "checkpoints"
    ckpt.mkdir(parents=True)
    (ckpt / "latest").write_text("global_step1")
    (ckpt / "tokenizer.json").write_text("{}")
    gpt = dict(vocab_size=257, n_layer=1, n_head=1, n_embd=8, block_size=8)
    (ckpt / "model.json").write_text(json.dumps(gpt))
    code, text = invoke("export-mixtral", str(tmp_path / "gpt"), str(tmp_path / "out"))
    assert code == 2 and "holds a GPT" in text and "z train --moe" in text, text
    code, text = invoke("export-mixtral", str(tmp_path / "none"), str(tmp_path / "out"))
    assert code == 2 and "is not a `z train` run" in text, text


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"moe_top_k": 3}, None),  # no --moe: the flag is refused
        ({"moe": True, "moe_experts": "4,x"}, r"`--moe-experts 4,x` is not a count"),
        (
            {"moe": True, "moe_experts": "2", "moe_top_k": 3},
            r"`--moe-top-k 3` must be between 1 and the fewest experts of a layer \(2",
        ),
        ({"moe": True, "moe_ep": 3}, r"`--moe-ep 3` must divide the 2 rank\(s\)"),
        ({"moe": True, "moe_experts": "6", "moe_ep": 4}, r"`--moe-ep 4` must divide the 2 rank"),
        (
            {"moe": True, "moe_experts": "3", "moe_ep": 2},
            r"`--moe-ep 2` must divide every layer's expert count \(`--moe-experts 3`\)",
        ),
        ({"moe": True, "moe_capacity_factor": 0.0}, r"`--moe-capacity-factor 0.0` must be pos"),
        (
            {"moe": True, "moe_dropless": True, "moe_capacity_factor": 2.0},
            r"`--moe-capacity-factor 2.0` has no effect with `--moe-dropless`",
        ),
        (
            {"moe": True, "moe_layers": "every-other", "moe_experts": "4,8,16"},
            r"3 expert counts \[4, 8, 16\] do not split the 2 MoE layers",
        ),
        ({"moe": True, "moe_layers": "odd"}, r"'odd' is not one of"),
    ],
)
def test_bad_moe_flags_fail_naming_the_numbers(
    flags: dict[str, object], message: str | None, tmp_path: Path
) -> None:
    opts = TrainOptions(out=tmp_path, preset="tiny", seq_len=64, explicit=frozenset(flags), **flags)  # type: ignore[arg-type]
    with pytest.raises(TrainError, match=message or r"`--moe-top-k` describes an MoE model"):
        plan_run(opts, world_size=2)


@pytest.mark.slow
def test_resume_at_another_ep_size(run: Path, tmp_path: Path) -> None:
    out = tmp_path / "resumed"
    shutil.copytree(run, out)
    flags = MOE[: MOE.index("--moe-ep")]  # one rank: ep 1
    code, text = invoke(
        "train", "--nproc", "1", "--resume", "--steps", "5", *TINY, *flags, "--out", str(out)
    )
    assert code == 0, text
    assert "steps 4 -> 5" in text
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r] == [1, 2, 3, 4, 5]


def test_resume_with_other_moe_flags_names_the_difference(run: Path) -> None:
    opts = TrainOptions(
        out=run,
        preset="tiny",
        seq_len=64,
        resume=True,
        steps=9,
        moe=True,
        moe_experts="8",
        moe_dropless=True,
    )
    with pytest.raises(TrainError, match=r"different MoE model: experts \(4, 4, 4, 4\) \(flags: "):
        plan_run(opts, world_size=1)
    with pytest.raises(TrainError, match=r"holds an MoE-architecture model; add `--moe`"):
        plan_run(TrainOptions(out=run, preset="tiny", seq_len=64, resume=True, steps=9), 1)
