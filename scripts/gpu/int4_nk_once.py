"""The one-row GEMVs once per Llama-3-8B shape and tiling, checked against the dequantized
reference first: the launches ``scripts/gpu/int4_ab.sh ncu`` and ``ncustall`` profile.
``int4_gemv_nk`` (8 and 16 rows a program) and, with ``--all``, ``int4_gemv_mma`` and the
int8 GEMV of the same structure (``int8_gemv_nk``, which reaches 87-92% of the copy
bandwidth on the wide layers where the int4 ones reach 44-62%: session 20's question is
what the int4 warps stall on that the int8 ones do not)."""

from __future__ import annotations

import sys

import torch

from tokenloom.plugins.quant.int4 import dequantize_int4, quantize_int4
from tokenloom.plugins.quant.int8 import dequantize_int8, quantize_int8
from tokenloom.plugins.quant.kernels.int4_gemv_mma import launch_int4_mma
from tokenloom.plugins.quant.kernels.int4_gemv_nk import launch_int4_nk
from tokenloom.plugins.quant.kernels.int8_gemv_nk import launch_int8_nk

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate/up, down
TILINGS = [(8, 4096, 4), (16, 4096, 4)]  # (BLOCK_N, BLOCK_K, warps) of INT4_NK
MMA_TILING = (16, 2048, 2)  # of INT4_NK_MMA
INT8_TILING = (8, 1024, 4)  # of NK (biased)


def check(name: str, y: torch.Tensor, expected: torch.Tensor) -> None:
    err = float((y.float() - expected).norm() / expected.norm())
    print(f"{name}: rel err {err:.2e}")
    assert err < 1e-2


def main() -> None:
    every = "--all" in sys.argv
    torch.manual_seed(0)
    for n, k in SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        qweight, scales, zeros = quantize_int4(w, 128)
        ref = dequantize_int4(qweight, scales, zeros, 128, torch.float32)
        qweight = qweight.t().contiguous().t()  # stored [N, K / 8]
        expected = x.float() @ ref.t()
        for block_n, block_k, warps in TILINGS:
            y = launch_int4_nk(x, qweight, scales, zeros, 128, None, block_n, block_k, warps)
            check(f"int4 nk {n}x{k} {block_n}x{block_k}/{warps}", y, expected)
        for block_n, block_k, warps in TILINGS:  # session 21: the integer products
            y = launch_int4_nk(x, qweight, scales, zeros, 128, None, block_n, block_k, warps, True)
            check(f"int4 dp4a {n}x{k} {block_n}x{block_k}/{warps}", y, expected)
        if not every:
            continue
        y = launch_int4_mma(x, qweight, scales, zeros, 128, None, *MMA_TILING)
        check(f"int4 mma {n}x{k} {MMA_TILING}", y, expected)
        q8, s8 = quantize_int8(w.float())  # the transposed view of [N, K] storage
        y = launch_int8_nk(x, q8, s8, None, *INT8_TILING, rows=1, biased=True)
        ref8 = dequantize_int8(q8, s8, torch.float32)
        check(f"int8 nk {n}x{k} {INT8_TILING}", y, x.float() @ ref8.t())
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
