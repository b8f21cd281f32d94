"""What act-order costs at decode (session 45): one Llama-3-8B layer's four int4
projections at 1 row, each replayed in a CUDA graph, as stored (``Int4Kernel``) and
behind the input gather of act-order checkpoints (``PermutedInputKernel``: one
``index_select`` more a projection; the fused SiLU / rope epilogues are not part of
either side here). Prints microseconds per layer and the share of a 32-layer step.

    PYTHONPATH=... python3 scripts/gpu/act_order_bench.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from tokenloom.plugins.models.cuda_timing import time_graph
from tokenloom.plugins.quant.common import PermutedInputKernel
from tokenloom.plugins.quant.int4 import Int4Kernel, quantize_int4

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        qweight, scales, zeros = quantize_int4(w, 128)
        qweight = qweight.t().contiguous().t()  # the row-major storage int4_kernel picks
        kernel = Int4Kernel(qweight, scales, zeros, 128)
        permuted = PermutedInputKernel(kernel, torch.randperm(k, device="cuda"))
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        plain = time_graph(lambda kern=kernel, v=x: kern.apply(v, None), 200, 7)
        gathered = time_graph(lambda kern=permuted, v=x: kern.apply(v, None), 200, 7)
        rows.append(
            {"projection": name, "n": n, "k": k, "plain_us": plain, "act_order_us": gathered}
        )
        print(f"{name:8s} {n:6d} x {k:6d}  plain {plain:7.2f} us  act-order {gathered:7.2f} us")
    extra = sum(r["act_order_us"] - r["plain_us"] for r in rows)
    print(f"per layer: +{extra:.2f} us; 32 layers: +{32 * extra / 1000:.3f} ms a decode step")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows,
                       "extra_us_per_layer": extra}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
