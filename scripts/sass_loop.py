"""Compile a Triton kernel for the H200 (sm_90) on a machine without a GPU and count
the SASS instructions of its hottest loop.

Triton's wheel carries ptxas and cuobjdump, so the machine code a kernel will run on
the H200 can be read here: instructions per weight (or per element) of the inner loop,
registers, spills, shared memory, whether the loads are vectorized (LDG.E.128) and the
MMAs are Hopper's (HGMMA) or Ampere's (HMMA). This is how the GEMV rewrite of session 7
was iterated with no device time: 6.88 -> 5.58 instructions per int4 weight before one
GPU run confirmed it (docs/quantization.md). It does not time anything: a kernel can
be bound by memory latency or by one slow unit (e.g. I2F) at any instruction count.

    python scripts/sass_loop.py gemv  [BLOCK_N BLOCK_K WARPS STAGES]
    python scripts/sass_loop.py rows  [BLOCK_N BLOCK_K WARPS STAGES ROWS]
    python scripts/sass_loop.py gemm  [BLOCK_M BLOCK_N BLOCK_K WARPS STAGES BITS]
    python scripts/sass_loop.py decode-bf16|decode-fp8|decode-int8 [BLOCK_N WARPS STAGES]

The decode presets compile the Triton decode attention over a 16-bit or 8-bit KV cache
(Llama-3-8B heads: 32 query, 8 KV, head_dim 128, pages of 16); "per KV byte" there.
Read on 2026-12-02: bf16 2.0-2.4 instructions per KV byte; fp8 5.7 (each fp8 value read
from shared memory by a 1-byte load, LDS.U8, then e4m3 -> f16 -> bf16 per element),
4.2 with f16 dot operands (the byte loads stay: Triton converts the layout before the
cast, at the narrow type). Since session 8 the kernel converts with opaque PTX helpers
in the load layout: fp8 2.8 (``KV_ASM=0`` in the environment compiles Triton's cast).
``MAXNREG=N`` caps the registers as the ``decode_maxnreg`` setting does.

The presets compile the weight-only quantized kernels with Llama-3-8B-like
specializations (every pointer and size divisible by 16, as Triton specializes them at
run time). ``--sass FILE`` keeps the full listing; ``TTGIR=FILE`` in the environment
writes Triton's layouts. The ``gemm`` preset takes ``KMAJOR=1`` (int4's K-major tile),
``DEQUANT_ASM=1`` (its PTX dequantization) and ``SWAP=1`` (the product transposed), ``NK=1`` (int8 stored ``[N, K]``, read by strides):
read on 2026-12-02 (session 9), 128x128x64 int4 went 10.6 -> 9.7 (K-major) -> 7.2
(PTX) instructions per weight, and 16x128x128 swapped 4.9. The ``gemv`` and ``rows``
presets compile the int4 GEMVs over ``[K / 8, N]`` (int8 has none since kernels v14).
``gemv`` takes ``ASM=1`` (the PTX conversion of ``gemv_weights``), ``BIASED=1`` (the
biased nibbles, as for 16-bit activations) and ``REDUCE=1`` (the in-kernel split sum):
read in session 10, 64x128 int4 5.47 -> 5.02 (``ASM=1 BIASED=1``), 5.08 with
``REDUCE=1``. ``GROUP=32`` (``gemv``, ``rows``) compiles int4 groups smaller than the
tile (a scale and a zero point per word row): 64x128 ``ASM=1 BIASED=1 REDUCE=1`` 4.42,
rows 64x128x4 2.67 per weight-row.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile
import warnings
from typing import Any

warnings.filterwarnings("ignore")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
LINE = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+ )?([A-Z0-9_.]+)([^;]*);")


def compile_sm90(
    fn: Any,
    signature: dict[str, str],
    constexprs: dict[str, Any],
    divisible: list[str],
    num_warps: int,
    num_stages: int,
) -> tuple[str, str]:
    """(SASS listing, resource usage) of ``fn`` compiled for sm_90."""
    sig = dict(signature)
    for name in constexprs:
        sig[name] = "constexpr"
    names = list(sig)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in divisible}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(
        src,
        target=GPUTarget("cuda", 90, 32),
        options={
            "num_warps": num_warps,
            "num_stages": num_stages,
            **({"maxnreg": int(os.environ["MAXNREG"])} if os.environ.get("MAXNREG") else {}),
        },
    )
    if os.environ.get("TTGIR"):  # the layouts Triton chose, for reading
        with open(os.environ["TTGIR"], "w") as f:
            f.write(compiled.asm["ttgir"])
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run(
            [f"{BIN}/cuobjdump", "-sass", f.name], capture_output=True, text=True, check=True
        ).stdout
        res = subprocess.run(
            [f"{BIN}/cuobjdump", "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    return sass, res, int(compiled.metadata.shared)


def hottest_loop(sass: str) -> list[tuple[int, str]]:
    """The instructions between the target and the source of the longest backward
    branch (the main loop, for the kernels here)."""
    ops = [
        (int(m.group(1), 16), m.group(3), m.group(4))
        for m in map(LINE.match, sass.splitlines())
        if m
    ]
    best = None
    for addr, op, rest in ops:
        target = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        if target and int(target.group(1), 16) < addr:
            span = (int(target.group(1), 16), addr)
            if best is None or span[1] - span[0] > best[1] - best[0]:
                best = span
    return [(a, op) for a, op, _ in ops if best and best[0] <= a <= best[1]]


QUANT_ARGS = ["x_ptr", "qw_ptr", "s_ptr", "z_ptr", "b_ptr", "y_ptr"]


def _quant_sig(
    bits: int, with_m: bool, extra: list[str], outputs: tuple[str, ...] = ()
) -> dict[str, str]:
    sig = {n: "*bf16" for n in QUANT_ARGS}
    sig["qw_ptr"] = "*i32" if bits == 4 else "*i8"
    for n in outputs:  # the one-row GEMV's o_ptr and cnt_ptr
        sig[n] = "*i32" if n == "cnt_ptr" else "*bf16"
    if with_m:
        sig["M"] = "i32"
    for n in ["N", "K", "K_CHUNK", "stride_xm", "stride_ym", "stride_ysplit", *extra]:
        sig[n] = "i32"
    return sig


def preset(name: str, values: list[int]) -> tuple[Any, dict, dict, list[str], int, int, float]:
    """(kernel, signature, constexprs, divisible args, warps, stages, work per thread)."""
    from tokenloom.plugins.quant.kernels import gemm_tile, weight_gemv, weight_gemv_rows

    divisible = QUANT_ARGS + ["N", "K", "K_CHUNK", "stride_xm", "stride_ym", "stride_ysplit"]
    if name in ("gemv", "rows"):
        bn, bk, warps, stages, *rest = values
        if len(rest) != (name == "rows"):  # no BITS: the GEMVs serve int4 only
            raise SystemExit(f"{name}: BLOCK_N BLOCK_K WARPS STAGES{' ROWS' * (name == 'rows')}")
        rows = rest[0] if name == "rows" else 1
        consts: dict[str, Any] = dict(
            BITS=4,
            GROUP=int(os.environ.get("GROUP", "128")),
            HAS_ZEROS=True,
            HAS_BIAS=False,
            PARTIAL=False,
            BLOCK_N=bn,
            BLOCK_K=bk,
        )
        if os.environ.get("BIASED") == "1" and name == "gemv":
            consts["BIASED"] = True
        if os.environ.get("ASM") == "1":
            consts["ASM"] = True
        if name == "rows":
            consts["ROWS"] = rows
            kernel = weight_gemv_rows._weight_gemv_rows_kernel
        else:
            kernel = weight_gemv._weight_gemv_kernel
        sig = _quant_sig(
            4,
            name == "rows",
            ["nibble"] if name == "rows" else ["nibble", "mask8", "mask12", "mask16"],
            () if name == "rows" else ("o_ptr", "cnt_ptr"),
        )
        if os.environ.get("REDUCE") == "1" and name == "gemv":
            consts.update(PARTIAL=True, REDUCE=True, SPLIT=4)
        if name == "gemv":  # every constexpr spelled out (Triton 3.9 needs the defaulted too)
            for flag, default in (("BIASED", False), ("ASM", False), ("REDUCE", False)):
                consts.setdefault(flag, default)
            consts.setdefault("USE_PDL", False)
            consts.setdefault("SPLIT", 1)
        return kernel, sig, consts, divisible, warps, stages, bn * bk * rows / (warps * 32)
    bm, bn, bk, warps, stages, bits = values
    consts = dict(
        BITS=bits,
        GROUP=128 if bits == 4 else 0,
        HAS_ZEROS=bits == 4,
        HAS_BIAS=False,
        PARTIAL=False,
        EXPAND=True,
        KMAJOR=bool(int(os.environ.get("KMAJOR", "0"))),
        DEQUANT_ASM=bool(int(os.environ.get("DEQUANT_ASM", "0"))),
        SWAP=bool(int(os.environ.get("SWAP", "0"))),
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        DOT_PRECISION="tf32",
    )
    sig = _quant_sig(bits, True, ["stride_qk", "stride_qn"])
    at = list(sig).index("K") + 1  # KQ, qweight's rows, follows K (positional signature)
    sig = dict([*list(sig.items())[:at], ("KQ", "i32"), *list(sig.items())[at:]])
    divisible = divisible + ["KQ"]
    # the weights' strides as Triton specializes them: 1 is a constant; NK=1 compiles
    # int8 stored [N, K] (session 16), else [K, N]
    unit = "stride_qk" if os.environ.get("NK") == "1" and bits == 8 else "stride_qn"
    del sig[unit]
    consts[unit] = 1
    divisible = divisible + ["stride_qn" if unit == "stride_qk" else "stride_qk"]
    return (
        gemm_tile._weight_gemm_kernel,
        sig,
        consts,
        divisible,
        warps,
        stages,
        bn * bk / (warps * 32),
    )


def decode_preset(kv: str, values: list[int]) -> tuple[Any, dict, dict, list[str], int, int, float]:
    from tokenloom.plugins.attention.triton_kernels.decode import _decode_kernel

    block_n, warps, stages = values
    cache = {"bf16": "*bf16", "fp8": "*fp8e4nv", "int8": "*i8"}[kv]
    scale = cache if kv == "bf16" else "*fp32"
    sig = {"q_ptr": "*bf16", "k_cache_ptr": cache, "v_cache_ptr": cache, "block_tables_ptr": "*i32",
           "seq_lens_ptr": "*i32", "out_ptr": "*bf16", "part_out_ptr": "*fp32",
           "part_lse_ptr": "*fp32", "counters_ptr": "*i32", "k_scale_ptr": scale,
           "v_scale_ptr": scale}  # fmt: skip
    strides = ["stride_q_tok", "stride_q_head", "stride_o_tok", "stride_o_head", "stride_bt",
               "stride_cache_block", "stride_cache_tok", "stride_cache_head",
               "stride_scale_block"]  # fmt: skip
    # the rope arguments (unused: ROPE off, as below 64 requests), in the kernel's order
    rope = {"k_new_ptr": "*bf16", "v_new_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
            "q_norm_ptr": "*bf16", "k_norm_ptr": "*bf16", "slot_ptr": "*i64",
            "stride_kn_tok": "i32", "stride_kn_head": "i32", "stride_vn_tok": "i32",
            "stride_vn_head": "i32", "stride_cos": "i32", "eps": "fp32"}  # fmt: skip
    sig.update(rope)
    sig.update({n: "i32" for n in strides})
    sig.update({"scale_log2": "fp32", "num_splits": "i32", "min_split": "i32"})
    consts = dict(
        NUM_HEADS=32,
        NUM_KV_HEADS=8,
        GROUP=4,
        HEAD_DIM=128,
        BLOCK_D=128,
        BLOCK_H=16,
        BLOCK_N=block_n,
        PAGE_SIZE=16,
        DOT_PRECISION="tf32",
        KV_QUANT=kv != "bf16",
        KV_F16=kv != "bf16",
        P_LIFT=512.0 if kv == "fp8" else 128.0,
        KV_ASM=kv != "bf16" and os.environ.get("KV_ASM", "1") == "1",
        HEADS_FIRST=True,
        ROPE=False,
        HAS_NORM=False,
        HALF=64,
        USE_PDL=True,
    )
    # session 20: the first tile read before the PDL wait. Every constexpr is passed, its
    # defaults included: Triton 3.6 fails to compile a kernel whose defaulted constexpr is
    # left out of ASTSource's (``'NoneType' object has no attribute '_unflatten_ir'``)
    consts["PREFETCH"] = os.environ.get("PREFETCH") == "1"
    # VT=1: values stored transposed per page (an fp8 pool's layout since session 29)
    consts["V_T"] = os.environ.get("VT") == "1"
    consts["V_STRIDE_D"] = 16 if consts["V_T"] else 1
    divisible = [n for n in sig if n.endswith("_ptr")] + [n for n in strides if n != "stride_bt"]
    kv_bytes = block_n * 128 * 2 * (1 if kv != "bf16" else 2) / (warps * 32)
    return _decode_kernel, sig, consts, divisible, warps, stages, kv_bytes


DEFAULTS = {
    "gemv": [64, 128, 4, 3],
    "rows": [64, 128, 4, 3, 4],
    "gemm": [128, 128, 64, 8, 3, 4],
    "decode-bf16": [32, 4, 2],
    "decode-fp8": [128, 4, 2],
    "decode-int8": [128, 4, 2],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("preset", choices=sorted(DEFAULTS))
    ap.add_argument("values", nargs="*", type=int)
    ap.add_argument("--sass", help="write the full SASS listing here")
    args = ap.parse_args()
    values = args.values or DEFAULTS[args.preset]
    if args.preset.startswith("decode-"):
        found = decode_preset(args.preset.removeprefix("decode-"), values)
    else:
        found = preset(args.preset, values)
    kernel, sig, consts, divisible, warps, stages, per_thread = found
    sass, res, shared = compile_sm90(kernel, sig, consts, divisible, warps, stages)
    if args.sass:
        with open(args.sass, "w") as f:
            f.write(sass)
    loop = hottest_loop(sass)
    counts = collections.Counter(op for _, op in loop)
    regs = re.search(r"REG:(\d+)", res)
    spills = sum(v for k, v in counts.items() if k.startswith(("LDL", "STL")))
    unit = {"rows": "weight-row"}.get(
        args.preset, "KV byte" if "decode" in args.preset else "weight"
    )
    print(
        f"{args.preset} {values}: loop {len(loop)} instructions, {per_thread:.0f} {unit}s per "
        f"thread per iteration = {len(loop) / per_thread:.2f} per {unit}; registers "
        f"{regs.group(1) if regs else '?'}, shared memory {shared} B, "
        f"spill instructions {spills}"
    )
    print("  " + " ".join(f"{k}:{v}" for k, v in counts.most_common(16)))


if __name__ == "__main__":
    main()
