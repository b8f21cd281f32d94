"""Issue 12's workload (600 x 1,000 in / 1,000 out at once, fp8 weights and KV) in the
scheduler lab with the fp8 decode attention's time scaled (session 29): what a faster
fp8 decode kernel would give, before it runs on a GPU.

    python scripts/sim_fp8_attention.py [SCALES [BATCHED_TOKENS]] [--overlap]
    python scripts/sim_fp8_attention.py 1,0.905,0.67,0.565 8192

A scale of 1 is the f16-converting kernel (1.77x its KV floor, ``tokenloom.sim.
quantized.FP8_KV_FACTOR_F16``); 0.905 the fp8-MMA decode, the engine's default since
session 32; 0.813 today's (session 37's tiles and session 38's fold on top: the lab's
default, ``FP8_KV_FACTOR``; 0.736 with pages of 64); 0.565 puts it at its KV floor by session
8's ratio (1.77 x 0.565 = 1.0; the lab, whose bf16 ``kv`` coefficient is 1.02, then
charges 1.06x). The printed "x its KV floor" is that ratio, 1.77 x the scale. Pages of
16 tokens, where these scales were measured (the lab models pages of 64 with
``FP8_PAGE_GAIN`` on top, session 52).

``--overlap`` (session 34) is a what-if, not a model: every step costs its KV reads or
its GEMMs, whichever is longer, instead of their sum (the other hidden under it), as if
the attention of one micro-batch ran beside the GEMMs of another with neither slowing
down. An upper bound on what such an overlap could give on this schedule.
"""

import json
import sys
import tempfile

import tokenloom.sim.quantized as quantized
from tokenloom.sim import cost_model
from tokenloom.sim.cli import main

BASE = quantized.FP8_KV_FACTOR_F16


def overlapped(self, f):  # CostModel.step_time with the KV reads beside the GEMMs
    c = self.coefficients
    p = {n: c.get(n, 0.0) * x for n, x in zip(cost_model.TERMS, self.terms(f), strict=True)}
    gpu = max(p["gemm"] + p["flops"], p["kv"]) + p["attn"] + p["seq"]
    if not self.launch_overlap:
        return p["const"] + p["eager"] + gpu
    return p["const"] + max(p["eager"], gpu)


def simulate(scale: float, batched_tokens: str) -> float:
    quantized.FP8_KV_FACTOR = BASE * scale
    out = tempfile.mkdtemp()
    main([
        "--num-requests", "600", "--request-rate", "inf", "--prompt-len", "1000",
        "--output-len", "1000", "--length-dist", "fixed", "--quant", "fp8",
        "--kv-cache-dtype", "fp8", "--max-num-seqs", "640", "--max-graph-batch", "640",
        "--max-num-batched-tokens", batched_tokens, "--block-size", "16",
        "--no-plots", "--out", out,
    ])  # fmt: skip
    with open(f"{out}/sim.json", encoding="utf-8") as f:
        return float(json.load(f)["runs"][0]["output_token_throughput"])


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--overlap"]
    if "--overlap" in sys.argv:
        cost_model.CostModel.step_time = overlapped
    scales = args[0] if args else "1,0.905,0.67,0.565"
    tokens = args[1] if len(args) > 1 else "8192"
    for scale in map(float, scales.split(",")):
        for batched in tokens.split(","):
            speed = simulate(scale, batched)
            print(f"attention x{scale:.3f} ({1.77 * scale:.2f}x its KV floor), "
                  f"--max-num-batched-tokens {batched}"
                  f"{', KV reads beside the GEMMs' if '--overlap' in sys.argv else ''}: "
                  f"{speed:,.0f} out tok/s", flush=True)  # fmt: skip
