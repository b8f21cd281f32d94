"""Dump the weight tuner's candidate lists (``dispatch.candidates`` per bucket, and
``dispatch.h2_candidates``) for the formats the engine uses, on the Llama-3-8B shapes, as
JSON: run it before and after a kernel refactor and diff the two files. An empty diff
means the tuner measures the same tilings, so the engine's choice cannot move (session 18:
the int8 [K, N] GEMVs removed, 145 lists identical).

Usage: python scripts/lab/tuner_candidates.py OUT.json
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

import torch

from tokenloom.plugins.quant.kernels import dispatch

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
# (bits, group, stored [N, K'], fractional zero points): int8 as stored since session 16,
# int4 in either storage, groups of 128 (RTN, AWQ, GPTQ) and of 32 (GGUF Q4_1)
FORMATS = [
    (8, 0, True, False),
    (4, 128, True, False),
    (4, 128, False, False),
    (4, 32, True, True),
    (4, 32, False, True),
]


def main(out: str) -> None:
    lists: dict[str, list] = {}
    for n, k in SHAPES:
        for bits, group, nk, frac in FORMATS:
            for i in range(len(dispatch.BUCKETS)):
                found = dispatch.candidates(i, n, k, bits, group, 132, frac, nk)
                lists[f"{n}x{k} int{bits} g{group} nk{nk} frac{frac} b{i}"] = [
                    asdict(c) for c in found
                ]
            for dtype in (torch.bfloat16, torch.float16):
                if not nk:
                    found = dispatch.h2_candidates(n, k, bits, group, True, dtype)
                    lists[f"{n}x{k} int{bits} g{group} h2 {dtype}"] = [asdict(c) for c in found]
    with open(out, "w") as f:
        json.dump(lists, f, indent=0, sort_keys=True)
    print(f"{len(lists)} lists -> {out}")


if __name__ == "__main__":
    main(sys.argv[1])
