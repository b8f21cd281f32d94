"""``int4_gemv_nk`` once per Llama-3-8B shape and tiling (8 and 16 rows a program), random
weights in groups of 128 stored ``[N, K / 8]``: the launches ``scripts/gpu/int4_ab.sh ncu``
profiles. Checks each against the dequantized reference first."""

from __future__ import annotations

import torch

from tokenloom.plugins.quant.int4 import dequantize_int4, quantize_int4
from tokenloom.plugins.quant.kernels.int4_gemv_nk import launch_int4_nk

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate/up, down
TILINGS = [(8, 4096, 4), (16, 4096, 4)]  # (BLOCK_N, BLOCK_K, warps) of INT4_NK


def main() -> None:
    torch.manual_seed(0)
    for n, k in SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        qweight, scales, zeros = quantize_int4(w, 128)
        ref = dequantize_int4(qweight, scales, zeros, 128, torch.float32)
        qweight = qweight.t().contiguous().t()  # stored [N, K / 8]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        expected = x.float() @ ref.t()
        for block_n, block_k, warps in TILINGS:
            y = launch_int4_nk(x, qweight, scales, zeros, 128, None, block_n, block_k, warps)
            err = float((y.float() - expected).norm() / expected.norm())
            print(f"{n}x{k} {block_n}x{block_k}/{warps}: rel err {err:.2e}")
            assert err < 1e-2
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
