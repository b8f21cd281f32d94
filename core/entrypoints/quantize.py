"""``tokenloom quantize [MODEL] --method int4|fp8 --out DIR``: calibrated weight
quantization into a checkpoint that ``--quant int4`` / ``--quant fp8`` load.

Steps: sample calibration text from the model itself (``plugins.quant.calibration``),
then ``plugins.quant.calibrated``: load the model in float32 on ``--device`` (a GPU
where there is one, else the CPU), round its decoder ``Linear`` layers one decoder layer at a time on
the outputs of the layers before them, already quantized, and write the directory. The
LM head and the embedding stay dense, as at load-time quantization.

- ``--rounding learned`` (int4's default): each decoder layer's rounding learned to
  reproduce the float model's stream (``plugins.quant.signround``); ``--rounding gptq``
  (fp8's default): GPTQ, each ``Linear``'s own output error (``plugins.quant.gptq``).
- ``--awq`` (int4, the default there): before a layer is rounded, its input channels
  are scaled by AWQ's searched scales (``plugins.quant.awq``), folded into the RMSNorm
  weights and the up / v rows, which the checkpoint then holds.
- ``--tune-scales STEPS``: afterwards, the scales and (``--tune-norms``, on by default)
  the RMS norms' weights trained on the whole model's next-token distributions
  (``plugins.quant.scale_tuning``); with ``--tune-codes RATE`` (int4, learned rounding)
  the codes train with them.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

DTYPES = ("float32", "float16", "bfloat16")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenloom quantize",
        description="Quantize a model's weights, calibrated on text sampled from the model "
        "itself (learned rounding or GPTQ, then optionally scale tuning), and write a "
        "checkpoint that the engine serves as it is (its config.json names the format; "
        "--quant int4 / --quant fp8 are then implied).",
    )
    parser.add_argument("model", nargs="?", help="model directory or .gguf (default: built-in)")
    parser.add_argument("--method", choices=("int4", "fp8"), required=True)
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory")
    parser.add_argument(
        "--format",
        default="gptq",
        choices=("gptq", "compressed-tensors"),
        help="of the checkpoint: gptq (int4 as GPTQ, fp8 as fbgemm_fp8; the default) or "
        "compressed-tensors (llm-compressor's format); the same codes and scales",
    )
    parser.add_argument(
        "--calibration-tokens",
        type=int,
        default=16384,
        metavar="N",
        help="tokens of self-generated calibration text (default 16384)",
    )
    parser.add_argument(
        "--calibration-cache",
        metavar="FILE",
        help="JSON of sampled sequences: read if it exists (same model, --seq-len, --seed; "
        "as many sequences or more), else written there",
    )
    parser.add_argument("--seq-len", type=int, default=256, metavar="N", help="per sequence")
    parser.add_argument("--group-size", type=int, default=128, metavar="N", help="int4 groups")
    parser.add_argument("--damping", type=float, default=0.01, metavar="F", help="x mean H_ii")
    parser.add_argument(
        "--act-order",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="visit the columns by decreasing input energy, group parameters fitted "
        "beforehand (groups stay k // group: every reader loads it); default: on for "
        "int4, off for fp8 (what measured better on the built-in model)",
    )
    parser.add_argument(
        "--awq",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="int4: scale each layer's input channels by AWQ's searched scales (folded "
        "into the RMSNorm weights and the up / v rows) before it is rounded; default: "
        "on for int4 (+15.5%% / +17.2%% perplexity on the built-in model against GPTQ "
        "alone's +23.5%% / +24.8%%, two calibration seeds), refused for fp8",
    )
    parser.add_argument(
        "--awq-clip",
        action="store_true",
        help="with --awq: also AWQ's clipping search (each group's range shrunk, 1 to "
        "0.55x, to the least output error; the built-in model measured worse with it)",
    )
    parser.add_argument(
        "--rounding",
        choices=("gptq", "learned"),
        default=None,
        help="gptq: each Linear's own output error, column by column; learned: each "
        "decoder layer's output, by signed gradient descent on every weight's rounding "
        "offset (plugins/quant/signround.py). Default: learned for int4 (+9.4%% to +10.1%% "
        "perplexity on the built-in model in three runs, against AWQ + GPTQ's +13.6%% to "
        "+17.2%%; 2.5x the time), gptq for fp8 (learned measured no better there)",
    )
    parser.add_argument("--iters", type=int, default=200, metavar="N", help="learned: per layer")
    parser.add_argument(
        "--batch",
        type=int,
        default=4,
        metavar="N",
        help="learned rounding and scale tuning: sequences per step",
    )
    parser.add_argument(
        "--target",
        choices=("float", "local"),
        default="float",
        help="learned: fit each layer to the float model's stream (default) or to the float "
        "layer on the quantized stream",
    )
    parser.add_argument(
        "--per-token",
        action="store_true",
        help="learned: each token's output error relative to its own mean square (so the "
        "attention sink's huge position-0 states do not outweigh the rest)",
    )
    parser.add_argument(
        "--head-kl",
        action="store_true",
        help="learned: fit the last layer to the float model's next-token distribution "
        "(KL through the final norm and LM head) instead of its output stream",
    )
    parser.add_argument(
        "--tune-scales",
        type=int,
        default=None,
        metavar="STEPS",
        help="after the rounding, train every int4 group's (fp8 row's) scale, codes and "
        "zero points fixed, for STEPS Adam steps on the whole model's next-token KL from "
        "the float model's (plugins/quant/scale_tuning.py; 0: off). Default: 256 for fp8 "
        "(on the built-in model's 64-passage text, three calibration samples: +0.32%%, "
        "+1.03%%, +1.03%% perplexity, mean +0.79%%; 64 steps +1.05%%; GPTQ alone +1.6-2.3%%), "
        "0 for int4 (it pays there with --calibration-tokens 65536: +10.1%% -> "
        "+7.2%%)",
    )
    parser.add_argument(
        "--tune-lr", type=float, default=1e-3, metavar="F", help="scale tuning: Adam's rate"
    )
    parser.add_argument(
        "--tune-norms",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="scale tuning: the RMS norms' weights train with the scales (default on: fp8 "
        "+0.99%% -> +0.66%% perplexity, mean of three samples; int4 +7.63%% -> +7.23%%)",
    )
    parser.add_argument(
        "--tune-codes",
        type=float,
        default=0.0,
        metavar="RATE",
        help="scale tuning (--tune-scales STEPS, int4, --rounding learned): the codes train "
        "too, at this Adam rate (round(w / s0 + v) at the rounding's own scales, every "
        "offset v in [-1/2, 1/2]; 0: off, the default). Experimental: the built-in model "
        "measured worse with it at 0.01 (+19.1%% perplexity against +7.2%%) and at 0.001 "
        "(+6.6%% against +6.0%%; docs/quantization.md says why)",
    )
    parser.add_argument("--seed", type=int, default=0, help="of the calibration sampling")
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="of the tensors left dense: embedding, norms, LM head (default float32)",
    )
    parser.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="where the model is sampled and quantized: auto (the default: cuda where "
        "there is a GPU, else cpu), cuda (the current GPU: CUDA_VISIBLE_DEVICES picks "
        "it) or cpu. float32 either way; a GPU rounds as the CPU does up to float noise",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        metavar="N",
        help="torch CPU threads (default 1; 0: one per core; more measured slower shared)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.calibration_tokens < 1 or args.seq_len < 16:
        print("error: --calibration-tokens >= 1 and --seq-len >= 16", file=sys.stderr)
        return 2
    if args.group_size < 8 or args.group_size % 8:
        print("error: --group-size must be a positive multiple of 8", file=sys.stderr)
        return 2
    if args.awq is None:
        args.awq = args.method == "int4"
    if args.rounding is None:
        args.rounding = "learned" if args.method == "int4" else "gptq"
    if args.tune_scales is None:
        args.tune_scales = 256 if args.method == "fp8" else 0
    if args.tune_scales < 0 or args.tune_codes < 0:
        print("error: --tune-scales STEPS >= 0 and --tune-codes RATE >= 0", file=sys.stderr)
        return 2
    if args.tune_codes and not (
        args.method == "int4" and args.rounding == "learned" and args.tune_scales
    ):
        print(
            "error: --tune-codes needs --method int4, --rounding learned and --tune-scales",
            file=sys.stderr,
        )
        return 2
    if (args.awq or args.awq_clip) and (args.method != "int4" or not args.awq):
        print("error: --awq is for --method int4; --awq-clip needs --awq", file=sys.stderr)
        return 2
    import torch

    from tokenloom.checkpoints.default_model import default_model
    from tokenloom.plugins.quant.calibrated import LearnedRounding, ScaleTuning, quantize_checkpoint
    from tokenloom.plugins.quant.calibration import sample_calibration_tokens

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda: no GPU here", file=sys.stderr)
        return 2
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    model_path = args.model or default_model()
    started = time.perf_counter()
    try:
        sequences = sample_calibration_tokens(
            model_path, args.calibration_tokens, args.seq_len, args.seed,
            args.calibration_cache, device,
        )  # fmt: skip
    except ValueError as e:  # a calibration cache of other settings
        print(f"error: {e}", file=sys.stderr)
        return 2
    sampled = time.perf_counter()
    print(
        f"calibration: {len(sequences)} sequences of {args.seq_len} tokens sampled "
        f"in {sampled - started:.0f} s ({device})",
        flush=True,
    )
    about = {
        "calibration": "sampled from the model: temperature 1, top-p 0.95, half from "
        "BOS, half from generic chat requests (plugins/quant/calibration.py)",
        "seq_len": args.seq_len,
        "seed": args.seed,
        "sample_seconds": round(sampled - started, 1),
    }
    quantize_checkpoint(
        model_path,
        args.method,
        Path(args.out),
        sequences,
        group=args.group_size,
        damping=args.damping,
        act_order=args.method == "int4" if args.act_order is None else args.act_order,
        dtype=getattr(torch, args.dtype),
        about=about,
        awq=args.awq,
        awq_clip=args.awq_clip,
        learned=LearnedRounding(args.iters, args.batch, args.target, args.per_token, args.head_kl)
        if args.rounding == "learned"
        else None,
        tune=ScaleTuning(
            args.tune_scales, args.batch, args.tune_lr, args.tune_norms, args.tune_codes
        )
        if args.tune_scales
        else None,
        device=device,
        fmt=args.format,
    )
    print(
        f"{args.rounding}: quantized in {time.perf_counter() - sampled:.0f} s; wrote {args.out} "
        f"(its config.json names the format: the engine loads it as {args.method})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
