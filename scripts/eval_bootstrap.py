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

from tokenloom import LLM, SamplingParams
from tokenloom.checkpoints.default_model import default_model
from tokenloom.eval import TEXT_PATH
from tokenloom.eval.perplexity import load_passages


def passage_nlls(model: str, quant: str, passages: list[str]) -> list[tuple[float, int]]:
    """Each passage's summed negative log-probability and its token count."""
    options = {"quant": quant} if quant != "none" else {}
    llm = LLM(model=model, dtype="float32", attention="torch", device="cpu", **options)
    try:
        prompts = [llm.tokenizer.encode(p) for p in passages]
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=True)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        result = []
        for ids, out in zip(prompts, outputs, strict=True):
            values = out.prompt_logprobs
            if values is None or len(values) != len(ids) - 1:
                raise RuntimeError(f"{model}: expected {len(ids) - 1} prompt logprobs")
            result.append((-math.fsum(values), len(values)))
        return result
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
    args = parser.parse_args()
    if args.threshold is None:
        args.threshold = 5.0 if args.quant == "int4" else 1.0
    if args.samples < 1:
        parser.error("--samples: at least 1")
    passages = load_passages(TEXT_PATH)
    names = ["reference", *args.checkpoints]
    nll = {"reference": passage_nlls(str(default_model()), "none", passages)}
    for ckpt in args.checkpoints:
        nll[ckpt] = passage_nlls(ckpt, args.quant, passages)
    tokens = torch.tensor([n for _, n in nll["reference"]], dtype=torch.float64)
    for name, rows in nll.items():  # one tokenizer: the same tokens scored by every model
        if [n for _, n in rows] != tokens.long().tolist():
            raise RuntimeError(f"{name}: its passages' token counts differ from the reference's")
    sums = {k: torch.tensor([s for s, _ in v], dtype=torch.float64) for k, v in nll.items()}
    gen = torch.Generator().manual_seed(args.seed)
    draws = torch.randint(len(passages), (args.samples, len(passages)), generator=gen)
    counts = tokens[draws].sum(1)
    log_ppl = {k: (v[draws].sum(1) / counts) for k, v in sums.items()}  # per draw
    point = {k: float(v.sum() / tokens.sum()) for k, v in sums.items()}

    def pct(x: float) -> float:
        return 100 * (math.exp(x) - 1)

    report: dict[str, object] = {
        "text": str(TEXT_PATH), "passages": len(passages), "tokens": int(tokens.sum()),
        "samples": args.samples, "quant": args.quant, "threshold_pct": args.threshold, "models": {}, "pairs": {},
    }  # fmt: skip
    for k in names[1:]:
        diff = log_ppl[k] - log_ppl["reference"]
        lo, hi = torch.quantile(diff, torch.tensor([0.025, 0.975], dtype=torch.float64))
        row = {
            "perplexity": math.exp(point[k]),
            "vs_reference_pct": pct(point[k] - point["reference"]),
            "interval_95_pct": [pct(float(lo)), pct(float(hi))],
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
            lo, hi = torch.quantile(diff, torch.tensor([0.025, 0.975], dtype=torch.float64))
            row = {
                "b_over_a_pct": pct(point[b] - point[a]),
                "interval_95_pct": [pct(float(lo)), pct(float(hi))],
            }
            report["pairs"][f"{b} vs {a}"] = row  # type: ignore[index]
            print(f"{b} vs {a}: {row['b_over_a_pct']:+.2f}% (95%: "
                  f"{row['interval_95_pct'][0]:+.2f}% to {row['interval_95_pct'][1]:+.2f}%)")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
