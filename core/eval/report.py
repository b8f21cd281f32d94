"""The evaluation report: a JSON-ready dict and the table printed from it.

Keys of the report (``tokenloom eval --json PATH`` writes exactly this):

- ``model``, ``config``: the model evaluated (file or directory name) and the
  resolved engine config; ``recorded``: whether this run rewrote the golden file.
- ``reference``: ``golden_file``, and the ``model`` and ``config`` it was recorded with.
- ``perplexity``, ``num_text_tokens``, ``num_passages``, ``nll_mean`` (= log perplexity).
- ``reference_perplexity`` (from the golden file), ``perplexity_delta`` (this minus
  the reference) and ``perplexity_delta_pct`` (relative, %); all three None when the
  golden file has no perplexity or was recorded on a different text.
- ``perplexity_delta_pct_95``: ``[low, high]``, the 95% interval of
  ``perplexity_delta_pct`` when the text's passages are resampled with replacement
  (``BOOTSTRAP_SAMPLES`` draws, paired with the golden file's own per-passage figures);
  None when the golden file has none for this text (recorded before they were kept).
- ``exact_match_pct``, ``token_agreement_pct`` (defined in ``tokenloom.eval``),
  ``num_prompts``, ``num_exact``, ``num_agreed_tokens``, ``num_reference_tokens``,
  and ``prompts``: per prompt ``id``, ``exact``, ``agreed_tokens``,
  ``reference_tokens``, ``output_tokens``, ``same_prompt_tokens``.
- ``timings``: ``load_s``, ``perplexity_s``, ``golden_s``, ``total_s`` (seconds), and
  ``threads`` (torch's CPU threads).
- ``warnings``: why the comparison may not be like for like (another model, another
  text, prompts that tokenize differently).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenloom.eval.perplexity import bootstrap_log_ratios, interval_pct

if TYPE_CHECKING:
    from tokenloom.eval.golden import GoldenScores, GoldenSet
    from tokenloom.eval.perplexity import PerplexityResult

BOOTSTRAP_SAMPLES = 10_000

REPORT_KEYS = (
    "model",
    "config",
    "recorded",
    "reference",
    "perplexity",
    "num_text_tokens",
    "num_passages",
    "nll_mean",
    "reference_perplexity",
    "perplexity_delta",
    "perplexity_delta_pct",
    "perplexity_delta_pct_95",
    "exact_match_pct",
    "token_agreement_pct",
    "num_prompts",
    "num_exact",
    "num_agreed_tokens",
    "num_reference_tokens",
    "prompts",
    "timings",
    "warnings",
)
CONFIG_SUMMARY = (
    "device",
    "dtype",
    "attention",
    "quant",
    "kv_cache_dtype",
    "proposer",
    "num_speculative_tokens",
)


def build_report(
    *,
    model: str,
    config: dict[str, Any],
    reference: GoldenSet,
    golden_path: str,
    text_sha256: str,
    perplexity: PerplexityResult,
    scores: GoldenScores,
    timings: dict[str, float],
    recorded: bool,
) -> dict[str, Any]:
    warnings = []
    if reference.model and reference.model != model:
        warnings.append(f"the golden file was recorded on {reference.model}, not {model}")
    ref_ppl = reference.perplexity
    if reference.text_sha256 != text_sha256:
        warnings.append("the golden file's perplexity was measured on another text")
        ref_ppl = None
    changed = [p["id"] for p in scores.per_prompt if not p["same_prompt_tokens"]]
    if changed:
        warnings.append(f"prompts tokenized differently from the recording: {', '.join(changed)}")
    ppl = perplexity.perplexity
    interval = None
    if ref_ppl is not None and reference.passage_tokens == perplexity.passage_tokens:
        ratios = bootstrap_log_ratios(
            perplexity.passage_nlls,
            reference.passage_nlls,
            perplexity.passage_tokens,
            BOOTSTRAP_SAMPLES,
        )
        interval = list(interval_pct(ratios))
    report = {
        "model": model,
        "config": config,
        "recorded": recorded,
        "reference": {
            "golden_file": golden_path,
            "model": reference.model,
            "config": reference.config,
        },
        "perplexity": ppl,
        "num_text_tokens": perplexity.num_tokens,
        "num_passages": perplexity.num_passages,
        "nll_mean": perplexity.nll_sum / perplexity.num_tokens,
        "reference_perplexity": ref_ppl,
        "perplexity_delta": None if ref_ppl is None else ppl - ref_ppl,
        "perplexity_delta_pct": None if ref_ppl is None else 100.0 * (ppl / ref_ppl - 1.0),
        "perplexity_delta_pct_95": interval,
        "exact_match_pct": scores.exact_match_pct,
        "token_agreement_pct": scores.token_agreement_pct,
        "num_prompts": len(scores.per_prompt),
        "num_exact": scores.num_exact,
        "num_agreed_tokens": scores.num_agreed_tokens,
        "num_reference_tokens": scores.num_reference_tokens,
        "prompts": scores.per_prompt,
        "timings": timings,
        "warnings": warnings,
    }
    assert tuple(report) == REPORT_KEYS
    return report


def format_table(report: dict[str, Any]) -> str:
    """The setup lines (this run, the reference), then one row per metric."""
    reference = report["reference"]
    ref_ppl = report["reference_perplexity"]
    delta = report["perplexity_delta"]
    interval = report["perplexity_delta_pct_95"]
    t = report["timings"]
    exact = f"{report['exact_match_pct']:.1f}% ({report['num_exact']}/{report['num_prompts']})"
    agreed = f"({report['num_agreed_tokens']}/{report['num_reference_tokens']} tokens)"
    rows = [
        (
            f"perplexity ({report['num_text_tokens']} tokens)",
            f"{report['perplexity']:.4f}",
            "-" if ref_ppl is None else f"{ref_ppl:.4f}",
            "-"
            if delta is None
            else f"{delta:+.4f} ({report['perplexity_delta_pct']:+.2f}%"
            + ("" if interval is None else f"; 95%: {interval[0]:+.2f}% to {interval[1]:+.2f}%")
            + ")",
        ),
        ("exact match", exact, "100%", ""),
        ("token agreement", f"{report['token_agreement_pct']:.1f}% {agreed}", "100%", ""),
    ]
    header = ("METRIC", "THIS RUN", "REFERENCE", "DELTA")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    lines = [
        f"this run:  {report['model']}: {_setup(report['config'])}",
        f"reference: {reference['model'] or '-'}: {_setup(reference['config'])}"
        f" ({reference['golden_file']})",
    ]
    lines += [
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in [header, *rows]
    ]
    lines.append(
        f"time (s): load {t['load_s']:.1f}, perplexity {t['perplexity_s']:.1f}, "
        f"golden {t['golden_s']:.1f}, total {t['total_s']:.1f} ({t['threads']} threads)"
    )
    lines += [f"warning: {w}" for w in report["warnings"]]
    return "\n".join(lines)


def _setup(config: dict[str, Any]) -> str:
    return ", ".join(f"{k}={config[k]}" for k in CONFIG_SUMMARY if k in config) or "-"
