"""Issue 12's workload (600 x 1,000 in / 1,000 out at once, fp8 weights and KV) in the
scheduler lab with the fp8 decode attention's time scaled (session 29): what a faster
fp8 decode kernel would give, before it runs on a GPU.

    python scripts/sim_fp8_attention.py [SCALES [BATCHED_TOKENS]]
    python scripts/sim_fp8_attention.py 1,0.85,0.67,0.565 8192

A scale of 1 is today's f16-converting kernel (1.77x its KV floor, ``tokenloom.sim.
quantized.FP8_KV_FACTOR``); 0.565 puts it at bf16's efficiency.
"""

import json
import sys
import tempfile

import tokenloom.sim.quantized as quantized
from tokenloom.sim.cli import main

BASE = quantized.FP8_KV_FACTOR


def simulate(scale: float, batched_tokens: str) -> float:
    quantized.FP8_KV_FACTOR = BASE * scale
    out = tempfile.mkdtemp()
    main([
        "--num-requests", "600", "--request-rate", "inf", "--prompt-len", "1000",
        "--output-len", "1000", "--length-dist", "fixed", "--quant", "fp8",
        "--kv-cache-dtype", "fp8", "--max-num-seqs", "640", "--max-graph-batch", "640",
        "--max-num-batched-tokens", batched_tokens, "--no-plots", "--out", out,
    ])  # fmt: skip
    with open(f"{out}/sim.json", encoding="utf-8") as f:
        return float(json.load(f)["runs"][0]["output_token_throughput"])


if __name__ == "__main__":
    scales = sys.argv[1] if len(sys.argv) > 1 else "1,0.85,0.67,0.565"
    tokens = sys.argv[2] if len(sys.argv) > 2 else "8192"
    for scale in map(float, scales.split(",")):
        for batched in tokens.split(","):
            speed = simulate(scale, batched)
            print(f"attention x{scale:.3f} ({1.77 * scale:.2f}x its KV floor), "
                  f"--max-num-batched-tokens {batched}: {speed:,.0f} out tok/s", flush=True)  # fmt: skip
