"""Checks of the lab f16x2 GEMV (``scripts/lab/gemv_h2.py``), no GPU needed.

    python scripts/lab/gemv_h2_check.py numerics   # exact emulation of its f16 FMAs vs fp32
    python scripts/lab/gemv_h2_check.py interp     # the kernel in the interpreter (fp16)
    python scripts/lab/gemv_h2_check.py sass [BLOCK_N BLOCK_K WARPS STAGES]
        # sm_90 SASS of its loop (Triton 3.6 with its CUDA backend, as scripts/sass_loop.py)
    python scripts/lab/gemv_h2_check.py gpu [OUT.json]
        # on a GPU: the ASM kernel against the reference and timed (cold) per Llama-3-8B
        # layer beside the engine's best one-row candidate

What the next GPU session must measure: the ASM path against ``int4.dequantize_int4``
(random weights, x outliers up to 3,000, fractional zeros); ``gemv_bench.py --cold
--rows 1`` per layer against the engine's GEMV; ncu on gate_up (issue utilization,
stall reasons); only then wire it in (PDL, in-kernel split sum, an x-range guard).
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
    from tokenloom.plugins.quant.int4 import unpack_int4

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
    import triton

    from tokenloom.plugins.quant.int4 import dequantize_int4, quantize_int4

    sys.path.insert(0, str(HERE))
    from gemv_h2 import _weight_gemv_h2_kernel

    torch.manual_seed(0)
    n, k, split = 256, 1024, 2
    qw, sc, zr = quantize_int4((torch.randn(n, k) * 0.02).half(), 128)
    x = torch.randn(k)
    x[7] = 1000.0
    x = x.half()  # fp16: the interpreter's bf16 is not trustworthy
    ref = x.float() @ dequantize_int4(qw, sc, zr, 128, torch.float32).t()
    y = torch.zeros(split, n)
    for bn, bk in [(128, 128), (64, 128)]:
        _weight_gemv_h2_kernel[(triton.cdiv(n, bn), split)](
            x, qw, sc, zr, y, n, k, k // split, 0, GROUP=128, BLOCK_N=bn, BLOCK_K=bk, ASM=False
        )
        err = (y.sum(0) - ref).abs()
        print(f"{bn}x{bk}: max err / max|y| {err.max() / ref.abs().max():.2e}")


def sass(args: list[str]) -> None:
    import collections
    import re

    sys.path[:0] = [str(HERE), str(HERE.parent)]
    import sass_loop
    from gemv_h2 import _weight_gemv_h2_kernel

    bn, bk, warps, stages = (int(a) for a in (args or ["128", "128", "4", "3"]))
    signature = {
        "x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*bf16",
        "y_ptr": "*fp32", "N": "i32", "K": "i32", "K_CHUNK": "i32", "xs_bits": "i32",
    }  # fmt: skip
    constexprs = {"GROUP": 128, "BLOCK_N": bn, "BLOCK_K": bk, "XSHIFT": 4, "ASM": True}
    divisible = ["x_ptr", "qw_ptr", "s_ptr", "z_ptr", "y_ptr", "N", "K", "K_CHUNK"]
    code, resources, _ = sass_loop.compile_sm90(
        _weight_gemv_h2_kernel, signature, constexprs, divisible, warps, stages
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


def gpu(args: list[str]) -> None:
    """Per Llama-3-8B layer at one row: every lab tiling checked against the dequantized
    reference (x with outliers) and timed cold (weights cycled through 150 MB, as
    gemv_bench.py --cold), the K-split partial sum included, beside the engine's best
    one-row candidate timed the same way."""
    import json

    import triton

    from tokenloom.plugins.models.cuda_timing import time_graph
    from tokenloom.plugins.quant.int4 import dequantize_int4, quantize_int4
    from tokenloom.plugins.quant.kernels.dispatch import bucket, candidates
    from tokenloom.plugins.quant.kernels.weight_gemm import weight_gemm

    sys.path.insert(0, str(HERE))
    from gemv_h2 import _weight_gemv_h2_kernel

    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = {
        "qkv": (6144, 4096),
        "o": (4096, 4096),
        "gate_up": (28672, 4096),
        "down": (4096, 14336),
    }
    xs_bits = 0x3D803D80  # bf16 2^-4 in both halves
    table = []
    for name, (n, k) in shapes.items():
        w = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
        qw, sc, zr = quantize_int4(w, 128)
        ref_w = dequantize_int4(qw, sc, zr, 128, torch.float32)
        x = torch.randn(1, k, device="cuda")
        x[0, 7], x[0, 100] = 1000.0, -300.0
        x = x.to(torch.bfloat16)
        ref = x.float() @ ref_w.t()
        rounding = float((ref.to(torch.bfloat16).float() - ref).norm() / ref.norm())
        nbytes = qw.numel() * 4 + sc.numel() * 2 + zr.numel() * 2
        copies = [(qw, sc, zr)] + [
            (qw.clone(), sc.clone(), zr.clone()) for _ in range((150 << 20) // nbytes)
        ]
        best_engine = None
        for cfg in candidates(bucket(1), n, k, 4, 128, sms):
            if not cfg.gemv:
                continue
            try:
                y = weight_gemm(x, qw, sc, zr, 4, 128, None, cfg).float()
                if float((y - ref).norm() / ref.norm()) > 2e-2:
                    continue

                def calls(cfg=cfg, x=x, copies=copies):
                    for q_, s_, z_ in copies:
                        weight_gemm(x, q_, s_, z_, 4, 128, None, cfg)

                t = time_graph(calls) / len(copies)
            except Exception as e:  # noqa: BLE001
                print(f"  engine skip {cfg}: {type(e).__name__}")
                continue
            if best_engine is None or t < best_engine[0]:
                best_engine = (t, str(cfg))
        results = []
        for bn in (64, 128, 256):
            for bk in (128,):
                for warps in (2, 4, 8):
                    for split in (1, 2, 4, 8):
                        if (k // split) % 128:
                            continue
                        y = torch.empty(split, n, device="cuda", dtype=torch.float32)
                        grid = (triton.cdiv(n, bn), split)

                        def lab(
                            y=y, grid=grid, bn=bn, bk=bk, warps=warps, split=split, q=qw, s=sc,
                            z=zr, x=x, n=n, k=k, sum_splits=True,
                        ):  # fmt: skip
                            _weight_gemv_h2_kernel[grid](
                                x, q, s, z, y, n, k, k // split, xs_bits,
                                GROUP=128, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                            )  # fmt: skip
                            if not sum_splits:
                                return None
                            return (
                                y.sum(0).to(torch.bfloat16)
                                if split > 1
                                else y[0].to(torch.bfloat16)
                            )

                        try:
                            out = lab().float()
                            err = float((out - ref).norm() / ref.norm())

                            def calls(lab=lab, copies=copies):
                                for q_, s_, z_ in copies:
                                    lab(q=q_, s=s_, z=z_)

                            t = time_graph(calls) / len(copies)

                            def kernel_only(lab=lab, copies=copies):
                                for q_, s_, z_ in copies:
                                    lab(q=q_, s=s_, z=z_, sum_splits=False)

                            t_kernel = time_graph(kernel_only) / len(copies)
                        except Exception as e:  # noqa: BLE001
                            print(
                                f"  lab skip {bn}x{bk} w{warps} s{split}: {type(e).__name__} {str(e)[:80]}"
                            )
                            continue
                        results.append((t, err, f"{bn}x{bk} w{warps} split{split}", t_kernel))
        results.sort()
        ok = [r for r in results if r[1] < 4 * rounding + 1e-3]
        t_lab, err, cfg, _ = (ok or results)[0]
        # the kernel alone, its split partials left unsummed (the engine's GEMV sums them in
        # the kernel, so its true cost lies between this and t_lab)
        t_kernel, cfg_kernel = min((r[3], r[2]) for r in (ok or results))
        row = dict(
            shape=name, n=n, k=k, engine_us=best_engine[0] if best_engine else None,
            engine_cfg=best_engine[1] if best_engine else None, lab_us=t_lab, lab_cfg=cfg,
            lab_kernel_only_us=t_kernel, lab_kernel_only_cfg=cfg_kernel,
            lab_err=err, bf16_rounding=rounding, gb_s_lab=nbytes / t_lab / 1e3,
            lab_top5=[(round(a, 2), round(b, 6), c, round(d, 2)) for a, b, c, d in results[:5]],
            worst_err=max(r[1] for r in results) if results else None,
        )  # fmt: skip
        table.append(row)
        print(json.dumps(row))
    print(
        "| layer | engine GEMV us | lab f16x2 + split sum us | lab kernel alone us | lab tiling |"
        " lab rel err (bf16 rounding) |"
    )
    for r in table:
        print(
            f"| {r['shape']} | {r['engine_us']:.1f} | {r['lab_us']:.1f} | "
            f"{r['lab_kernel_only_us']:.1f} | {r['lab_cfg']} | "
            f"{r['lab_err']:.2e} ({r['bf16_rounding']:.2e}) |"
        )
    print(
        f"per layer: engine {sum(r['engine_us'] for r in table):.1f} us, "
        f"lab {sum(r['lab_us'] for r in table):.1f} us, "
        f"lab kernel alone {sum(r['lab_kernel_only_us'] for r in table):.1f} us"
    )
    if args:
        with open(args[0], "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "numerics"
    if mode == "gpu":
        gpu(sys.argv[2:])
    else:
        {"numerics": numerics, "interp": interp}.get(mode, lambda: sass(sys.argv[2:]))()
