"""Golden completions: recording then replaying a config, and scoring a different one."""

from __future__ import annotations

import json

import pytest

from tokenloom.config import load_config
from tokenloom.eval import GOLDEN_PATH, PROMPTS_PATH, TEXT_PATH
from tokenloom.eval.evaluate import evaluate
from tokenloom.eval.golden import (
    GoldenPrompt,
    GoldenRun,
    GoldenSet,
    common_prefix,
    load_golden,
    score,
)
from tokenloom.eval.perplexity import load_passages

PROMPTS = {
    "about": "test prompts",
    "max_tokens": 8,
    "prompts": [
        {"id": "chat", "kind": "chat", "messages": [{"role": "user", "content": "Hello there"}]},
        {"id": "plain", "kind": "completion", "prompt": "The river runs"},
        {"id": "code", "kind": "completion", "prompt": "def add(a, b):"},
    ],
}
TEXT = "The river runs slowly past the mill.\n\nBread needs flour, water and salt.\n"


@pytest.fixture()
def files(tmp_path):
    (tmp_path / "prompts.json").write_text(json.dumps(PROMPTS))
    (tmp_path / "text.txt").write_text(TEXT)
    return tmp_path


def _evaluate(model_dir, files, record=False, **options):
    config = load_config(None, model=str(model_dir), dtype="float32", **options)
    return evaluate(
        config,
        golden_path=files / "golden.json",
        text_path=files / "text.txt",
        record=record,
        prompts_path=files / "prompts.json",
    )


def test_recording_then_evaluating_the_same_config_agrees_fully(tiny_model_factory, files):
    model_dir = tiny_model_factory("llama")
    recorded = _evaluate(model_dir, files, record=True)
    golden = load_golden(files / "golden.json")
    assert golden.is_recorded and golden.max_tokens == 8
    assert golden.perplexity == pytest.approx(recorded["perplexity"])
    assert all(p.completion_token_ids for p in golden.prompts)

    report = _evaluate(model_dir, files)
    assert report["exact_match_pct"] == 100.0
    assert report["token_agreement_pct"] == 100.0
    assert report["num_reference_tokens"] == sum(
        len(p.completion_token_ids or []) for p in golden.prompts
    )
    assert report["perplexity_delta"] == pytest.approx(0.0, abs=1e-9)
    assert report["warnings"] == []


def test_a_perturbed_model_agrees_less_than_fully(tiny_model_factory, files):
    _evaluate(tiny_model_factory("llama"), files, record=True)
    report = _evaluate(tiny_model_factory("llama", seed=1), files)  # other random weights
    assert report["exact_match_pct"] < 100.0
    assert report["token_agreement_pct"] < 100.0
    assert report["perplexity_delta"] != pytest.approx(0.0)
    lo, hi = report["perplexity_delta_pct"], report["perplexity_delta_pct"]
    assert report["perplexity_delta_pct_95"][0] <= lo and hi <= report["perplexity_delta_pct_95"][1]


def test_a_golden_file_without_passage_figures_gives_no_interval(tiny_model_factory, files):
    _evaluate(tiny_model_factory("llama"), files, record=True)
    golden = json.loads((files / "golden.json").read_text())
    del golden["passage_nlls"], golden["passage_tokens"]  # recorded before they were kept
    (files / "golden.json").write_text(json.dumps(golden))
    report = _evaluate(tiny_model_factory("llama", seed=1), files)
    assert report["perplexity_delta_pct"] is not None
    assert report["perplexity_delta_pct_95"] is None


def test_evaluating_needs_a_recorded_golden_file(tiny_model_factory, files):
    config = load_config(None, model=str(tiny_model_factory("llama")), dtype="float32")
    with pytest.raises(ValueError, match="record"):
        evaluate(config, golden_path=files / "prompts.json", text_path=files / "text.txt")


def _prompt(ref: list[int]) -> GoldenPrompt:
    return GoldenPrompt(
        "p", "completion", prompt="x", prompt_token_ids=[1], completion_token_ids=ref
    )


def test_token_agreement_counts_reference_tokens_up_to_the_first_divergence():
    golden = GoldenSet([_prompt([1, 2, 3, 4]), _prompt([5, 6]), _prompt([7, 8])])
    run = GoldenRun(
        prompt_token_ids=[[1], [1], [1]],
        completion_token_ids=[[1, 2, 9, 4], [5, 6], [7]],  # diverges at 2; exact; stops early
        completion_texts=["", "", ""],
        seconds=0.0,
    )
    scores = score(golden, run)
    assert scores.num_exact == 1
    assert scores.exact_match_pct == pytest.approx(100 / 3)
    assert (scores.num_agreed_tokens, scores.num_reference_tokens) == (2 + 2 + 1, 8)
    assert scores.token_agreement_pct == pytest.approx(100 * 5 / 8)
    assert common_prefix([1, 2], [1, 2, 3]) == 2


def test_the_shipped_golden_file_is_recorded_from_the_shipped_prompts_and_text():
    import hashlib

    prompts = load_golden(PROMPTS_PATH)
    golden = load_golden(GOLDEN_PATH)
    assert golden.is_recorded
    assert [p.id for p in golden.prompts] == [p.id for p in prompts.prompts]
    assert [(p.messages, p.prompt) for p in golden.prompts] == [
        (p.messages, p.prompt) for p in prompts.prompts
    ]
    assert golden.text_sha256 == hashlib.sha256(TEXT_PATH.read_bytes()).hexdigest()
    assert golden.config["dtype"] == "float32" and golden.config["attention"] == "torch"
    assert 20 <= len(golden.prompts) <= 30 and len(load_passages(TEXT_PATH)) >= 8
