"""Checks of the f16x2 int4 GEMV (``plugins/quant/kernels/int4_gemv_h2.py``, opt-in:
``TOKENLOOM_INT4_H2=1``; a lab kernel until session 13).

    python scripts/lab/gemv_h2_check.py numerics   # exact emulation of its f16 FMAs vs fp32
    python scripts/lab/gemv_h2_check.py interp     # the kernel in the interpreter (fp16)
    python scripts/lab/gemv_h2_check.py sass [BLOCK_N BLOCK_K WARPS STAGES]
        # sm_90 SASS of its loop (Triton 3.6 with its CUDA backend, as scripts/sass_loop.py)
    python scripts/lab/gemv_h2_check.py gpu [OUT.json]
        # on a GPU: every tiling against the reference and timed (cold) per Llama-3-8B
        # layer beside the engine's best one-row candidate
    python scripts/lab/gemv_h2_check.py ablate [OUT.json]
        # on a GPU: what the engine wiring (range guard, PDL, split sum) costs against
        # session 13's lab kernel, one ablation at a time, per layer

Session 14 (one H200): ``gpu`` put the kernel as wired into the engine at 71.3 us per
layer against the engine GEMV's 62.6 (the lab kernel alone, session 13: 49.5), faster
only on gate_up; ``ablate`` says which part of the wiring costs what.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def emulate(x, qweight, scales, zeros, group=128, xshift=4, center=8, flush_words=2):
    """The kernel's arithmetic: every fma.rn.f16x2 rounds once to f16 (computed in f64,
    then rounded), two chains per column flushed to fp32 every ``flush_words`` words,
    the fp32 epilogue ``s (P - (z - 8) xs)`` per tile."""
    from tokenloom.plugins.quant.int4_pack import unpack_int4

    q = unpack_int4(qweight).double()  # [K, N]
    xs = x.to(torch.bfloat16).double() * 2.0**-xshift  # exact: a power of two
    xh = xs.to(torch.float16).double()
    k, n = q.shape
    w = q - center
    span = 8 * flush_words
    blocks = k // span
    partial = torch.zeros(blocks, n, dtype=torch.float64)
    for b in range(blocks):
        halves = []
        for h in (0, 1):
            acc = torch.zeros(n, dtype=torch.float64)
            for kk in range(b * span, (b + 1) * span):
                if (kk % 8) // 4 == h:
                    acc = (acc + w[kk] * xh[kk]).to(torch.float16).double()
            halves.append(acc.float())
        partial[b] = (halves[0] + halves[1]).double()
    xsum = xs.float().view(blocks, span).sum(1).double()
    g = (torch.arange(blocks) * span) // group
    s = scales.float()[g].double()
    z = zeros.float()[g].double() - center
    return (s * (partial - z * xsum[:, None])).float().sum(0) * 2.0**xshift


def numerics() -> None:
    from tokenloom.plugins.quant.int4 import dequantize_int4, quantize_int4

    torch.manual_seed(0)
    cases = [
        (4096, 1000.0, False),
        (4096, 1000.0, True),
        (14336, 3000.0, False),
        (4096, 0.0, False),
    ]
    for k, outlier, fractional in cases:
        qw, sc, zr = quantize_int4((torch.randn(256, k) * 0.02).to(torch.bfloat16), 128)
        if fractional:
            zr = (zr.float() + torch.rand_like(zr.float()) - 0.5).to(torch.bfloat16)
        x = torch.randn(k)
        if outlier:
            x[7], x[100] = outlier, -outlier / 3
        x = x.to(torch.bfloat16)
        ref = x.float() @ dequantize_int4(qw, sc, zr, 128, torch.float32).t()
        err = (emulate(x, qw, sc, zr) - ref).abs()
        rounding = (ref.to(torch.bfloat16).float() - ref).abs()
        rms = ref.pow(2).mean().sqrt()
        print(
            f"K={k} outlier={outlier} fractional zeros={fractional}: rms err "
            f"{err.pow(2).mean().sqrt() / rms:.2e}, max err / max|y| {err.max() / ref.abs().max():.2e}"
            f" (bf16 output rounding alone: rms {rounding.pow(2).mean().sqrt() / rms:.2e})"
        )


def interp() -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    from tokenloom.plugins.quant.int4 import dequantize_int4, quantize_int4
    from tokenloom.plugins.quant.kernels.weight_gemm import GemmConfig, weight_gemm

    torch.manual_seed(0)
    n, k = 256, 1024
    qw, sc, zr = quantize_int4((torch.randn(n, k) * 0.02).half(), 128)
    x = torch.randn(1, k)
    x[0, 7] = 1000.0
    x = x.half()  # fp16: the interpreter's bf16 is not trustworthy
    ref = x.float() @ dequantize_int4(qw, sc, zr, 128, torch.float32).t()
    for bn, split in [(128, 1), (64, 2)]:
        y = weight_gemm(x, qw, sc, zr, 4, 128, None, GemmConfig(1, bn, 128, split, 4, 3, h2=True))
        err = (y.float() - ref).abs()
        print(f"{bn}x128 split {split}: max err / max|y| {err.max() / ref.abs().max():.2e}")


def sass(args: list[str]) -> None:
    import collections
    import re

    sys.path[:0] = [str(HERE.parent)]
    import sass_loop

    from tokenloom.plugins.quant.kernels.int4_gemv_h2 import _int4_gemv_h2_kernel

    bn, bk, warps, stages = (int(a) for a in (args or ["128", "128", "4", "3"]))
    signature = {
        "x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*bf16",
        "b_ptr": "*bf16", "y_ptr": "*bf16", "o_ptr": "*bf16", "cnt_ptr": "*i32",
        "N": "i32", "K": "i32", "K_CHUNK": "i32", "stride_ysplit": "i32",
    }  # fmt: skip
    constexprs = {
        "GROUP": 128, "BLOCK_N": bn, "BLOCK_K": bk, "HAS_BIAS": False, "PARTIAL": False,
        "REDUCE": False, "ASM": True, "USE_PDL": False, "AMAX_BLOCK": 1024,
        "GUARD": True, "SPLIT": 1,
    }  # fmt: skip
    divisible = ["x_ptr", "qw_ptr", "s_ptr", "z_ptr", "y_ptr", "N", "K", "K_CHUNK"]
    code, resources, _ = sass_loop.compile_sm90(
        _int4_gemv_h2_kernel, signature, constexprs, divisible, warps, stages
    )
    loop = sass_loop.hottest_loop(code)
    ops = collections.Counter(op for _, op in loop)
    per_thread = bn * bk / (warps * 32)
    regs = re.search(r"REG:(\d+)", resources)
    spills = sum(v for op, v in ops.items() if op.startswith(("LDL", "STL")))
    print(
        f"h2 {bn}x{bk} w{warps}: loop {len(loop)} instructions, {len(loop) / per_thread:.2f} "
        f"per weight; registers {regs.group(1) if regs else '?'}; spills {spills}"
    )
    print("  " + " ".join(f"{op}:{count}" for op, count in ops.most_common(16)))


SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def _layers():
    """Per Llama-3-8B layer: int4 g128 weights, one bf16 row with outliers (1,000 and
    -300), the dequantized reference, and copies of the weights filling 150 MB (timed
    cold, as ``gemv_bench.py --cold``)."""
    from tokenloom.plugins.quant.int4 import dequantize_int4, quantize_int4

    torch.manual_seed(0)
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
        qw, sc, zr = quantize_int4(w, 128)
        ref_w = dequantize_int4(qw, sc, zr, 128, torch.float32)
        x = torch.randn(1, k, device="cuda")
        x[0, 7], x[0, 100] = 1000.0, -300.0
        x = x.to(torch.bfloat16)
        ref = x.float() @ ref_w.t()
        nbytes = qw.numel() * 4 + sc.numel() * 2 + zr.numel() * 2
        copies = [(qw, sc, zr)] + [
            (qw.clone(), sc.clone(), zr.clone()) for _ in range((150 << 20) // nbytes)
        ]
        yield name, n, k, x, ref, nbytes, copies


def _timed(call, x, ref, copies):
    """(microseconds per call over the copies in one CUDA graph, relative error)."""
    from tokenloom.plugins.models.cuda_timing import time_graph

    qw, sc, zr = copies[0]
    y = call(x, qw, sc, zr).float()
    y = y.sum(0) if y.dim() == 3 else y  # partials alone: summed here, outside the timing
    err = float((y - ref).norm() / ref.norm())

    def calls():
        for q_, s_, z_ in copies:
            call(x, q_, s_, z_)

    return time_graph(calls) / len(copies), err


def gpu(args: list[str]) -> None:
    """Per Llama-3-8B layer at one row: every tiling of the kernel (``H2`` x splits 1-16,
    through ``weight_gemm``: the split sum in the kernel) checked against the dequantized
    reference and timed cold, beside the engine's best one-row GEMV timed the same way."""
    import json
    from dataclasses import replace

    from tokenloom.plugins.quant.kernels.dispatch import H2, bucket, candidates
    from tokenloom.plugins.quant.kernels.weight_gemm import weight_gemm

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    table = []
    for name, n, k, x, ref, nbytes, copies in _layers():
        rounding = float((ref.to(torch.bfloat16).float() - ref).norm() / ref.norm())

        def timed(cfg, x=x, ref=ref, copies=copies):
            return _timed(lambda *a: weight_gemm(*a, 4, 128, None, cfg), x, ref, copies)

        engine, h2 = [], []
        for cfg in candidates(bucket(1), n, k, 4, 128, sms):
            if cfg.gemv:
                engine.append((*timed(cfg), str(cfg)))
        for cfg in H2:
            for split in (1, 2, 4, 8, 16):
                if split * 2 <= k // 128:
                    c = replace(cfg, split_k=split)
                    h2.append((*timed(c), f"{c.block_n}x{c.block_k} w{c.num_warps} split{split}"))
        engine = sorted(r for r in engine if r[1] < 2e-2)
        h2.sort()
        row = dict(
            shape=name, n=n, k=k, engine_us=engine[0][0], engine_cfg=engine[0][2],
            h2_us=h2[0][0], h2_cfg=h2[0][2], h2_err=h2[0][1], bf16_rounding=rounding,
            h2_gb_s=nbytes / h2[0][0] / 1e3, h2_top5=[(round(t, 2), c) for t, _, c in h2[:5]],
            h2_worst_err=max(r[1] for r in h2),
        )  # fmt: skip
        table.append(row)
        print(json.dumps(row))
    print("| layer | engine GEMV us | f16x2 GEMV us | its tiling | its rel err (bf16 rounding) |")
    for r in table:
        print(
            f"| {r['shape']} | {r['engine_us']:.1f} | {r['h2_us']:.1f} | {r['h2_cfg']} | "
            f"{r['h2_err']:.2e} ({r['bf16_rounding']:.2e}) |"
        )
    print(
        f"per layer: engine {sum(r['engine_us'] for r in table):.1f} us, "
        f"f16x2 {sum(r['h2_us'] for r in table):.1f} us"
    )
    if args:
        with open(args[0], "w") as f:
            json.dump(table, f, indent=1)


# what the engine wiring costs, one thing at a time (session 14 also measured a shift
# per row pair of each tile, computed from the x words in the loop: 55.7 us per layer
# against the per-split guard's 54.3, so it was not kept)
ABLATIONS = {
    "engine (guard, PDL, split sum)": {},
    "no guard": {"GUARD": False},
    "no PDL": {"USE_PDL": False, "launch_pdl": False},
    "partials (no sum)": {"partials": True},
    "no guard, partials": {"GUARD": False, "partials": True},
}  # fmt: skip


def ablate(args: list[str]) -> None:
    """Per layer, per ablation: the best of ``H2`` x splits 4-16, launched directly
    (``launch_h2`` with the ablation's overrides), timed cold."""
    import json
    from dataclasses import replace

    import triton

    from tokenloom.plugins.quant.kernels.dispatch import H2
    from tokenloom.plugins.quant.kernels.int4_gemv_h2 import launch_h2
    from tokenloom.plugins.quant.kernels.weight_gemv import reduce_counters

    def call_for(cfg, n, k, overrides):
        lab = {key: v for key, v in overrides.items() if key != "partials"}
        k_chunk = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
        split = triton.cdiv(k, k_chunk)

        def call(x, qw, sc, zr):
            shape = (split, 1, n) if split > 1 else (1, n)
            y = torch.empty(shape, dtype=torch.float32 if split > 1 else x.dtype, device=x.device)
            reduce = split > 1 and not overrides.get("partials")
            out = torch.empty(1, n, dtype=x.dtype, device=x.device) if reduce else None
            counters = reduce_counters(x.device, triton.cdiv(n, cfg.block_n)) if reduce else None
            launch_h2(x, qw, sc, zr, 4, 128, None, y, 1, n, k, k_chunk, split, cfg, out, counters,
                      **lab)  # fmt: skip
            return out if reduce else y

        return call

    results = {}
    for name, n, k, x, ref, nbytes, copies in _layers():
        for label, overrides in ABLATIONS.items():
            runs = []
            for cfg in H2:
                for split in (4, 8, 16):
                    if split * 2 <= k // 128:
                        c = replace(cfg, split_k=split)
                        t, err = _timed(call_for(c, n, k, overrides), x, ref, copies)
                        runs.append((t, err, f"{c.block_n} w{c.num_warps} s{split}"))
            runs.sort()
            results.setdefault(label, {})[name] = dict(
                us=runs[0][0], cfg=runs[0][2], err=runs[0][1], gb_s=nbytes / runs[0][0] / 1e3,
                top3=[(round(t, 2), c) for t, _, c in runs[:3]],
            )  # fmt: skip
            print(label, name, json.dumps(results[label][name]), flush=True)
    print("| variant | " + " | ".join(SHAPES) + " | per layer |")
    for label, row in results.items():
        cells = " | ".join(f"{row[s]['us']:.1f} ({row[s]['cfg']})" for s in SHAPES)
        print(f"| {label} | {cells} | {sum(row[s]['us'] for s in SHAPES):.1f} |")
    if args:
        with open(args[0], "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "numerics"
    if mode in ("gpu", "ablate"):
        {"gpu": gpu, "ablate": ablate}[mode](sys.argv[2:])
    else:
        {"numerics": numerics, "interp": interp}.get(mode, lambda: sass(sys.argv[2:]))()
