"""How much of a perplexity difference on `tokenloom eval`'s text is the text's sampling
(issue 12): each model's per-token log-probabilities on the eval text (the same passages
and requests as ``tokenloom eval``), then a paired bootstrap over the passages.

    python scripts/eval_bootstrap.py [--quant int4] [--threshold 5] [--samples 10000] [--out F] CKPT...

For each checkpoint: its perplexity against the built-in float model's and the 95%
interval of that ratio, and how often it falls below ``--threshold`` percent (the
issue's bound: 5 for int4, 1 for fp8 and int8), when the passages are resampled with replacement (the same draw
for every model, so the comparison is paired); then each pair of checkpoints' difference
in the same way. A passage is the unit of resampling because its tokens are not
independent of one another; with 16 passages, percentile intervals tend to run a little
narrow. fp32, torch attention, CPU, as the issue's quality tables.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from tokenloom import LLM
from tokenloom.checkpoints.default_model import default_model
from tokenloom.eval import TEXT_PATH
from tokenloom.eval.perplexity import (
    bootstrap_log_ratios,
    interval_pct,
    load_passages,
    measure_perplexity,
)


def passage_nlls(model: str, quant: str, passages: list[str]) -> tuple[list[float], list[int]]:
    """Each passage's summed negative log-probability, and its token counts."""
    options = {"quant": quant} if quant != "none" else {}
    llm = LLM(model=model, dtype="float32", attention="torch", device="cpu", **options)
    try:
        result = measure_perplexity(llm, passages)
        return result.passage_nlls, result.passage_tokens
    finally:
        llm.engine.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("checkpoints", nargs="+")
    parser.add_argument("--quant", default="int4")
    parser.add_argument("--threshold", type=float, default=None, help="percent (default: "
                        "the issue's bound for --quant, 5 for int4, else 1)")  # fmt: skip
    parser.add_argument("--samples", type=int, default=10000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--text", default=str(TEXT_PATH), help="the passages (eval's text)")
    args = parser.parse_args()
    if args.threshold is None:
        args.threshold = 5.0 if args.quant == "int4" else 1.0
    if args.samples < 1:
        parser.error("--samples: at least 1")
    passages = load_passages(args.text)
    names = ["reference", *args.checkpoints]
    ref_nlls, tokens = passage_nlls(str(default_model()), "none", passages)
    nlls = {}
    for ckpt in args.checkpoints:
        nlls[ckpt], counts = passage_nlls(ckpt, args.quant, passages)
        if counts != tokens:  # one tokenizer: the same tokens scored by every model
            raise RuntimeError(f"{ckpt}: its passages' token counts differ from the reference's")
    # one seed: every model's resamples draw the same passages, so pairs are paired too
    log_ppl = {"reference": torch.zeros(args.samples, dtype=torch.float64)}
    point = {"reference": 0.0}
    for k, v in nlls.items():
        log_ppl[k] = bootstrap_log_ratios(v, ref_nlls, tokens, args.samples, args.seed)
        point[k] = (math.fsum(v) - math.fsum(ref_nlls)) / sum(tokens)

    def pct(x: float) -> float:
        return 100 * (math.exp(x) - 1)

    report: dict[str, object] = {
        "text": str(args.text), "passages": len(passages), "tokens": sum(tokens),
        "samples": args.samples, "quant": args.quant, "threshold_pct": args.threshold, "models": {}, "pairs": {},
    }  # fmt: skip
    for k in names[1:]:
        diff = log_ppl[k] - log_ppl["reference"]
        row = {
            "perplexity": math.exp(math.fsum(nlls[k]) / sum(tokens)),
            "vs_reference_pct": pct(point[k] - point["reference"]),
            "interval_95_pct": list(interval_pct(diff)),
            "p_below_threshold": float((diff < math.log1p(args.threshold / 100)).double().mean()),
        }
        report["models"][k] = row  # type: ignore[index]
        print(f"{k}: {row['vs_reference_pct']:+.2f}% (95%: {row['interval_95_pct'][0]:+.2f}% "
              f"to {row['interval_95_pct'][1]:+.2f}%), below {args.threshold:g}% in "
              f"{row['p_below_threshold']:.1%} "
              "of resamples")  # fmt: skip
    for i, a in enumerate(names[1:]):
        for b in names[i + 2 :]:
            diff = log_ppl[b] - log_ppl[a]
            row = {
                "b_over_a_pct": pct(point[b] - point[a]),
                "interval_95_pct": list(interval_pct(diff)),
            }
            report["pairs"][f"{b} vs {a}"] = row  # type: ignore[index]
            print(f"{b} vs {a}: {row['b_over_a_pct']:+.2f}% (95%: "
                  f"{row['interval_95_pct'][0]:+.2f}% to {row['interval_95_pct'][1]:+.2f}%)")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
