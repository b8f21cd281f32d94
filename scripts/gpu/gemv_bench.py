"""Sweep the weight-only GEMV/GEMM tilings on the Llama-3-8B decode shapes (one H200).

For each shape and format (int4 g128, int8) and row count (1, 4), every candidate the
dispatcher offers (``dispatch.candidates``) is checked against the dequantized
reference and timed in a CUDA graph (``time_graph``: the median of 5 rounds of 20
replays, after a warm-up); the table gives the best, its tiling, the weight bytes
it streams per microsecond (GB/s) and that as % of the measured device-to-device
copy bandwidth. Runs against whatever tokenloom is installed, so the same script
times the code before and after a kernel change.

    python scripts/gpu/gemv_bench.py [--rows 1,4] [--cold] [--json out.json]

``--cold`` times each tiling over enough copies of the weight (at least 3x the 50 MB L2
of an H200, cycled in the graph) that every call reads it from HBM, as the engine's
decode step does: without it, the small layers (qkv, o: 8-13 MB in int4) stay in L2
across the timed replays and measure faster than they run in the engine.

Each row also prints the best time of each kernel kind (the GEMV, the f16x2 GEMV at one
row, the dot kernel, the
int4 dot kernel's K-major tile, and with ``TOKENLOOM_WEIGHT_DEQUANT=1`` the whole weight
dequantized then cuBLAS, offered from 257 rows) and bf16 ``F.linear`` (cuBLAS) on the
same shape.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

import torch
import torch.nn.functional as F

from tokenloom.bench.latency import copy_bandwidth
from tokenloom.plugins.models.cuda_timing import time_graph
from tokenloom.plugins.quant.int4 import dequantize_int4, quantize_int4
from tokenloom.plugins.quant.int8 import dequantize_int8, quantize_int8
from tokenloom.plugins.quant.kernels.dispatch import (  # COLD_BYTES: 3x an H200's L2
    COLD_BYTES,
    bucket,
    candidates,
    h2_candidates,
)
from tokenloom.plugins.quant.kernels.int4_tiles import int4_row_major
from tokenloom.plugins.quant.kernels.int8_gemv_nk import row_major
from tokenloom.plugins.quant.kernels.weight_gemm import weight_gemm

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def _kind(c) -> str:
    if c.h2:
        return "h2"
    if c.nk:
        return "mma" if c.mma else "dp4a" if getattr(c, "dp4a", False) else "nk"
    return "dequant" if c.dequant else "kmajor" if c.kmajor else "gemv" if c.gemv else "dot"


def same_bytes(cold: bool) -> None:
    """Per int4 shape: the best bf16 one-row GEMV over ``[N, K / 4]`` bf16, cold as the
    int4 rows are timed (the int4 weight's bytes, without its scales and zero points)."""
    from tokenloom.plugins.models.skinny_gemm import GEMV_CONFIGS, gemv

    peak = copy_bandwidth() / 1e9
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k // 4, device="cuda", dtype=torch.bfloat16)
        ws = [w] + [w.clone() for _ in range(-(-COLD_BYTES // w.nbytes) - 1 if cold else 0)]
        x = torch.randn(1, k // 4, device="cuda", dtype=torch.bfloat16)
        best = min(
            (time_graph(lambda c=c, x=x, ws=ws: [gemv(x, w_, c) for w_ in ws]) / len(ws), c)
            for c in GEMV_CONFIGS
        )
        gbs = w.nbytes / best[0] / 1e3
        print(f"same bytes, bf16 GEMV {name:8s} {n}x{k // 4}: {best[0]:6.1f} us {gbs:6.0f} GB/s "
              f"{100 * gbs / peak:5.1f}%  {best[1]}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--bits", default="4,8")
    ap.add_argument("--json")
    ap.add_argument("--cold", action="store_true", help="read the weights from HBM every call")
    ap.add_argument(
        "--int8-layout",
        choices=("nk", "kn"),
        default="nk",
        help="int8 storage: [N, K] as the engine keeps it since session 16, or [K, N] as "
        "before (no GEMV there: the int8 GEMVs over [K, N] went with kernels v14)",
    )
    ap.add_argument(
        "--int4-layout",
        choices=("nk", "kn"),
        default="nk",
        help="int4 storage: [N, K / 8] as the engine keeps it since session 17, or [K / 8, N]",
    )
    ap.add_argument(
        "--same-bytes",
        action="store_true",
        help="also the bf16 one-row GEMV (skinny_gemm.gemv) over [N, K / 4] bf16: the int4 "
        "weight's bytes in rows of the same length, with one FMA a weight (session 20: is "
        "the int4 GEMV's 44-62%% of the copy bandwidth its rows' geometry or its arithmetic?)",
    )
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.same_bytes:
        same_bytes(args.cold)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    peak = copy_bandwidth() / 1e9  # the latency bench's roofline bandwidth, GB/s
    print(f"copy bandwidth {peak:.0f} GB/s")
    rows_out = []
    for bits in [int(b) for b in args.bits.split(",")]:
        for name, (n, k) in SHAPES.items():
            w = torch.randn(n, k, device="cuda") / k**0.5
            if bits == 8:
                qw, s = quantize_int8(w)
                if args.int8_layout == "kn":
                    qw = qw.contiguous()
                z, group = None, 0
                ref_w = dequantize_int8(qw, s, torch.bfloat16)
            else:
                qw, s, z = quantize_int4(w.to(torch.bfloat16), 128)
                if args.int4_layout == "nk":
                    qw = qw.t().contiguous().t()
                group = 128
                ref_w = dequantize_int4(qw, s, z, group, torch.bfloat16)
            nbytes = qw.numel() * qw.element_size() + s.numel() * s.element_size()
            nbytes += 0 if z is None else z.numel() * z.element_size()
            copies = [(qw, s, z)]
            if args.cold:  # cycle through >= 150 MB of weights: none is in L2 when read
                for _ in range(-(-COLD_BYTES // nbytes) - 1):
                    copies.append((qw.clone(), s.clone(), None if z is None else z.clone()))
            for m in [int(r) for r in args.rows.split(",")]:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ref = F.linear(x.float(), ref_w.float())
                results = []
                nk = row_major(qw) if bits == 8 else int4_row_major(qw)
                offered = candidates(bucket(m), n, k, bits, group, sms, nk=nk)
                if m == 1 and not nk:  # the one-row f16x2 kernels, as the tuner offers them
                    offered += h2_candidates(n, k, bits, group, z is not None, x.dtype)
                for cfg in offered:
                    try:
                        y = weight_gemm(x, qw, s, z, bits, group, None, cfg).float()
                        err = float((y - ref).norm() / ref.norm())
                        if err > 2e-2:
                            print(f"  WRONG {name} int{bits} m{m} {cfg}: {err:.3g}")
                            continue

                        def calls(cfg=cfg, x=x, copies=copies, bits=bits, group=group):
                            for q_, s_, z_ in copies:
                                weight_gemm(x, q_, s_, z_, bits, group, None, cfg)

                        t = time_graph(calls) / len(copies)
                    except Exception as e:  # noqa: BLE001
                        print(f"  skip {cfg}: {type(e).__name__} {str(e)[:80]}")
                        continue
                    results.append((t, cfg))
                results.sort(key=lambda r: r[0])
                t, cfg = results[0]
                # the best of each kind, and cuBLAS in 16 bits on the same shape (what the
                # quantized layer competes with at this batch)
                kinds = {}
                for tt, c in results:
                    kinds.setdefault(_kind(c), tt)
                # [N, K] row-major, as the engine stores it (the reference's strides are
                # column-major: cuBLAS picks other kernels for that layout)
                w16s = [ref_w.to(torch.bfloat16).contiguous()]
                if args.cold:
                    w16s += [w16s[0].clone() for _ in range(-(-COLD_BYTES // (n * k * 2)) - 1)]

                def cublas(x=x, w16s=w16s):
                    for w16 in w16s:
                        F.linear(x, w16)

                kinds["bf16_cublas"] = time_graph(cublas) / len(w16s)
                print(f"  {name} m={m}: " + " ".join(f"{k} {v:.1f}" for k, v in kinds.items()))
                gbs = nbytes / t / 1e3
                rows_out.append(
                    dict(
                        bits=bits,
                        shape=name,
                        n=n,
                        k=k,
                        rows=m,
                        us=t,
                        gb_s=gbs,
                        pct=100 * gbs / peak,
                        config=asdict(cfg),
                        top5=[(round(tt, 2), asdict(c)) for tt, c in results[:5]],
                        every=[(round(tt, 2), asdict(c)) for tt, c in results],
                        best_by_kind=kinds,
                    )
                )
                c = cfg
                print(
                    f"int{bits} {name:8s} m={m} {t:7.1f} us {gbs:6.0f} GB/s {100 * gbs / peak:5.1f}%  "
                    f"gemv={c.gemv} rows={c.rows} bn={c.block_n} bk={c.block_k} split={c.split_k} "
                    f"w={c.num_warps} st={c.num_stages}"
                )
    print("\nbits shape     rows      us    GB/s   %copy")
    for r in rows_out:
        print(
            f"int{r['bits']} {r['shape']:8s} {r['rows']:4d} {r['us']:7.1f} {r['gb_s']:7.0f} {r['pct']:6.1f}"
        )
    per_layer = {}
    for r in rows_out:
        per_layer.setdefault((r["bits"], r["rows"]), 0.0)
        per_layer[(r["bits"], r["rows"])] += r["us"]
    for (b, m), us in sorted(per_layer.items()):
        print(f"int{b} rows {m}: {us:.1f} us per layer (qkv+o+gate_up+down)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(copy_gb_s=peak, cold=args.cold, rows=rows_out), f, indent=1)


if __name__ == "__main__":
    main()
