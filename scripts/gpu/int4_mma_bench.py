"""int4 one-row GEMVs over ``[N, K / 8]`` on the Llama-3-8B shapes, cold (weights cycled
through >= 150 MB, none in L2): ``int4_gemv_nk`` against ``int4_gemv_mma`` reading the
scales as ``[G, N]`` bf16 arrays or packed ``[N, G]`` (``pack_scales``). Session 19's
question: whether the scale and zero-point gathers (8 sectors a warp load for ``[G, N]``)
bound these kernels rather than their instructions. Checks each against the reference.

    python scripts/gpu/int4_mma_bench.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json

import torch

from tokenloom.bench.latency import copy_bandwidth
from tokenloom.plugins.models.cuda_timing import time_graph
from tokenloom.plugins.quant.int4 import dequantize_int4, quantize_int4
from tokenloom.plugins.quant.kernels.int4_gemv_mma import launch_int4_mma, pack_scales
from tokenloom.plugins.quant.kernels.int4_gemv_nk import launch_int4_nk

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
COLD_BYTES = 150 << 20
TILINGS = [(16, 4096, 4), (16, 2048, 2), (8, 4096, 4), (32, 1024, 4), (16, 1024, 4)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.manual_seed(0)
    peak = copy_bandwidth() / 1e9
    print(f"copy bandwidth {peak:.0f} GB/s")
    out = {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        qw, s, z = quantize_int4(w, 128)
        s, z = s.to(torch.bfloat16), z.to(torch.bfloat16)
        ref = dequantize_int4(qw, s, z, 128, torch.float32)
        qw = qw.t().contiguous().t()
        nbytes = qw.numel() * 4 + s.numel() * 4
        copies = [(qw, s, z, pack_scales(s, z))]
        for _ in range(-(-COLD_BYTES // nbytes) - 1):
            copies.append(tuple(t.clone().t().contiguous().t() if t is qw else t.clone()
                                for t in copies[0]))  # fmt: skip
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        expected = x.float() @ ref.t()
        best = {}
        for kind in ("nk", "mma", "mma_packed"):
            for bn, bk, warps in TILINGS:

                def one(q, s_, z_, p_, bn=bn, bk=bk, warps=warps, kind=kind, x=x):
                    if kind == "nk":
                        return launch_int4_nk(x, q, s_, z_, 128, None, bn, bk, warps)
                    packed = p_ if kind == "mma_packed" else None
                    return launch_int4_mma(x, q, s_, z_, 128, None, bn, bk, warps, packed)

                try:
                    y = one(*copies[0]).float()
                    err = float((y - expected).norm() / expected.norm())
                    assert err < 1e-2, f"rel err {err:.2e}"
                    t = time_graph(lambda one=one, cs=copies: [one(*c) for c in cs]) / len(copies)
                except Exception as e:  # noqa: BLE001
                    print(
                        f"  {name} {kind} {bn}x{bk}/{warps}: skip {type(e).__name__} {str(e)[:60]}"
                    )
                    continue
                print(f"  {name} {kind} {bn}x{bk}/{warps}: {t:.2f} us  err {err:.1e}")
                if t < best.get(kind, (1e9,))[0]:
                    best[kind] = (t, (bn, bk, warps))
        out[name] = {
            kd: dict(us=t, tiling=c, pct=100 * nbytes / t / 1e3 / peak)
            for kd, (t, c) in best.items()
        }
    print("\nshape     " + "".join(f"{kd:>22s}" for kd in ("nk", "mma", "mma_packed")))
    for name, r in out.items():
        print(f"{name:9s} " + "".join(
            f"{r[kd]['us']:9.2f} us {r[kd]['pct']:5.1f}%   " if kd in r else " " * 22
            for kd in ("nk", "mma", "mma_packed")))  # fmt: skip
    for kd in ("nk", "mma", "mma_packed"):
        print(f"{kd}: {sum(r[kd]['us'] for r in out.values() if kd in r):.1f} us per layer")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(copy_gb_s=peak, shapes=out), f, indent=1)


if __name__ == "__main__":
    main()
