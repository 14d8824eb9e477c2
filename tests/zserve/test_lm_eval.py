"""lm-eval's `local-completions` model against zserve on loopback (SmolLM2): one
loglikelihood task and one generate_until task (`lm_eval_tasks/`), 20 documents each,
built from the Shakespeare corpus at test time. No network: the data is a local JSONL and
the tokenizer SmolLM2's directory.

lm-eval must run to completion; the loglikelihood task's accuracy must beat chance (1/4),
every generation must be non-empty, and one of lm-eval's loglikelihoods must equal the
one zserve reports for the same tokens (echo + logprobs over `/v1/completions`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.utils.models import smollm2_dir
from tests.zserve.server.conftest import _spoken_lines, serving

TASKS = Path(__file__).parent / "lm_eval_tasks"
DOCS = 20
CONTEXT_WORDS = 6
CHOICE_WORDS = 4
LL_ATOL = 1e-3  # lm-eval's batch and the check's differ: float summation order


def _docs() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(multiple-choice docs, generation docs) from spoken lines of at least 10 words."""
    lines = [ln.split() for ln in _spoken_lines() if len(ln.split()) >= 10][: 4 * DOCS]
    end = CONTEXT_WORDS + CHOICE_WORDS
    mc, gen = [], []
    for i in range(DOCS):
        words = lines[i]
        context = " ".join(words[:CONTEXT_WORDS])
        # the distractors: the same word positions of three other lines
        others = [lines[(i + k * DOCS // 4 + 1) % len(lines)] for k in range(1, 4)]
        choices = [" ".join(w[CONTEXT_WORDS:end]) for w in [words, *others]]
        mc.append({"context": context, "choices": choices, "label": 0})
        gen.append({"context": context, "target": " ".join(words[CONTEXT_WORDS:end])})
    return mc, gen


def _task(name: str, data: Path) -> dict[str, Any]:
    config = yaml.safe_load((TASKS / f"{name}.yaml").read_text(encoding="utf-8"))
    config["dataset_kwargs"]["data_files"]["test"] = str(data)
    return config


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.mark.slow
def test_lm_eval_scores_a_served_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))
    monkeypatch.setenv("OPENAI_API_KEY", "unused")
    import lm_eval

    from zserve.engine import Engine

    mc_docs, gen_docs = _docs()
    tasks = [
        _task("shakespeare_next_words", _write_jsonl(tmp_path / "mc.jsonl", mc_docs)),
        _task("shakespeare_continue", _write_jsonl(tmp_path / "gen.jsonl", gen_docs)),
    ]
    engine = Engine(smollm2_dir(), max_model_len=512, max_num_seqs=64, token_budget=512)
    with serving(engine) as server:
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args={
                "model": engine.model_name,
                "base_url": f"{server.url}/v1/completions",
                "tokenizer_backend": "huggingface",
                "tokenizer": str(smollm2_dir()),
                "tokenized_requests": True,
                "max_length": 512,
                "max_retries": 1,
            },
            tasks=tasks,
            batch_size=16,
            log_samples=True,
        )
        assert results is not None
        mc = results["results"]["zserve_shakespeare_next_words"]
        gen = results["results"]["zserve_shakespeare_continue"]
        chance = sum(1 / len(d["choices"]) for d in mc_docs) / len(mc_docs)
        assert chance < mc["acc,none"] <= 1.0, (mc, chance)
        assert 0.0 <= gen["exact_match,none"] <= 1.0, gen

        samples = results["samples"]
        outputs = [s["filtered_resps"][0] for s in samples["zserve_shakespeare_continue"]]
        assert len(outputs) == DOCS and all(o.strip() for o in outputs), outputs

        # one loglikelihood, recomputed from zserve's own prompt logprobs
        first = min(samples["zserve_shakespeare_next_words"], key=lambda s: s["doc_id"])
        doc = mc_docs[first["doc_id"]]
        ll_lm_eval = first["resps"][0][0][0]  # choice 0: (loglikelihood, is_greedy)
        tok = engine.tokenizer
        ctx = tok.encode(doc["context"])
        whole = tok.encode(doc["context"] + " " + doc["choices"][0])
        assert whole[: len(ctx)] == ctx
        body = {
            "model": engine.model_name,
            "prompt": whole,
            "max_tokens": 0,
            "echo": True,
            "logprobs": 0,
        }
        got = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        ll_zserve = sum(got["choices"][0]["logprobs"]["token_logprobs"][len(ctx) :])
        print(
            f"lm-eval: acc {mc['acc,none']:.2f} (chance {chance:.2f}), exact_match "
            f"{gen['exact_match,none']:.2f}; doc 0 loglikelihood {ll_lm_eval:.4f} "
            f"(zserve {ll_zserve:.4f})"
        )
        assert ll_lm_eval == pytest.approx(ll_zserve, abs=LL_ATOL)
