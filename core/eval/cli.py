"""``tokenloom eval [MODEL] [config flags...]``: the quality of one setup against the
recorded reference. Prints the table last; ``--json PATH`` writes the report."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from tokenloom.entrypoints.cli import add_config_flags, config_from_args
from tokenloom.eval import GOLDEN_PATH, PROMPTS_PATH, TEXT_PATH


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenloom eval",
        description="Perplexity on a fixed text and greedy agreement with recorded golden "
        "completions, for any engine config (compare e.g. --dtype bfloat16 or --quant X "
        "against the fp32 reference recorded in the golden file).",
    )
    parser.add_argument("model_dir", nargs="?", help="model directory or .gguf (default: built-in)")
    parser.add_argument("--config", metavar="FILE", help="TOML config file")
    parser.add_argument("--golden", default=str(GOLDEN_PATH), metavar="PATH", help="golden file")
    parser.add_argument("--text", default=str(TEXT_PATH), metavar="PATH", help="perplexity text")
    parser.add_argument(
        "--record",
        action="store_true",
        help="rewrite the golden file from this config (record with the fp32 reference: "
        "--dtype float32 --attention torch --device cpu)",
    )
    parser.add_argument(
        "--prompts", default=str(PROMPTS_PATH), metavar="PATH", help="prompts to --record"
    )
    parser.add_argument("--max-tokens", type=int, metavar="N", help="with --record: new tokens")
    parser.add_argument("--json", metavar="PATH", help="write the report as JSON")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        metavar="N",
        help="torch CPU threads (default 1; 0: torch's default, one per core). The eval's "
        "small batches gain little from more threads on the CPU, and lose several times "
        "over when other processes keep the cores busy",
    )
    add_config_flags(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    from tokenloom.eval.evaluate import evaluate
    from tokenloom.eval.report import format_table

    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    try:
        report = evaluate(
            config,
            golden_path=args.golden,
            text_path=args.text,
            record=args.record,
            prompts_path=args.prompts,
            max_tokens=args.max_tokens,
        )
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.record:
        print(f"recorded {report['num_prompts']} golden completions into {args.golden}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(format_table(report))
    return 0
