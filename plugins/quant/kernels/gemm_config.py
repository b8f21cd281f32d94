"""A weight GEMM tiling (``GemmConfig``: which kernel of ``weight_gemm`` runs a layer, with
what tiles) and the fixed heuristic ``choose_config`` (off the GPU, and the fallback
where a tuned tiling cannot serve a call)."""

from __future__ import annotations

from dataclasses import dataclass

import triton

from tokenloom.plugins.quant.kernels.weight_gemv import gemv_fits

SKINNY_ROWS = 16


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    expand: bool = True  # int4: unpack words and broadcast group scales by reshape
    gemv: bool = False  # weight_gemv's FMA kernel (int4), one program row per row of x
    rows: int = 1  # the GEMV's rows of x per program: 1, 2 or 4
    kmajor: bool = False  # int4 dot kernel: the tile built [N, K] (one group per tile)
    swap: bool = False  # kmajor: out^T = W x^T, the weights the MMA's register operand
    dequant: bool = False  # dequantize the whole weight (kernels/dequant.py), then cuBLAS
    h2: bool = False  # one row in packed f16x2 arithmetic (int4_gemv_h2)
    nk: bool = False  # stored [N, K]: int8_gemv_nk (``rows`` rows of x), int4_gemv_nk
    biased: bool = False  # nk: weights as 2^15 + 128 + q, the bias taken off per word
    mma: bool = False  # nk int4: the products on the tensor cores (int4_gemv_mma)
    dp4a: bool = False  # nk int4: the products on the integer unit (int4_dp4a_asm)

    def kmajor_fits(self, bits: int, group: int) -> bool:
        return self.kmajor and bits == 4 and group > 0 and group % self.block_k == 0

    def fits(self, bits: int, group: int) -> bool:
        """Whether this tiling can serve the format (the reshape path needs the tile
        and the group to nest, as must the GEMV's; K-major tiles lie in one group)."""
        if self.nk:  # int8_gemv_nk (1-4 rows), int4_gemv_nk (one row, groups of 32 k)
            if bits == 8:
                return group == 0 and self.rows in (1, 2, 4)
            modulus = 128 if self.mma else 32  # int4_gemv_mma: a quad of lanes, one group
            return bits == 4 and group > 0 and group % modulus == 0 and self.rows == 1
        if self.dequant:
            from tokenloom.plugins.quant.kernels.dequant import fits as dequant_fits

            return dequant_fits(bits, group)
        if self.h2:  # int4 only, as the GEMV (int8: no GEMV over [K, N])
            return bits == 4 and group > 0 and group % self.block_k == 0
        if self.gemv:
            return gemv_fits(bits, group, self.block_k, bits == 4 and group > 0, self.rows)
        if self.kmajor:
            return self.kmajor_fits(bits, group)
        if not self.expand or bits == 8 or group == 0:
            return True
        return self.block_k % group == 0 or group % self.block_k == 0


def choose_config(m: int, n: int, k: int, num_sms: int, nk: bool = False) -> GemmConfig:
    """Tiles by batch size: a K-split weight stream for decode batches, square tiles
    above (enough programs for about two waves over the GPU's SMs); ``nk``: int8 stored
    ``[N, K]`` that ``int8_gemv_nk`` serves, which takes up to four rows."""
    if nk and m <= 4:
        return GemmConfig(1, 8, 1024, 1, 4, 3, nk=True, rows=1 if m == 1 else 2 if m == 2 else 4)
    if m <= SKINNY_ROWS:
        block_n, block_k = 64, 256
        tiles = triton.cdiv(n, block_n)
        k_blocks = triton.cdiv(k, block_k)
        split = 1
        while tiles * split < 2 * num_sms and split * 2 <= max(1, k_blocks // 2):
            split *= 2
        return GemmConfig(SKINNY_ROWS, block_n, block_k, split, num_warps=4, num_stages=4)
    if m <= 64:
        return GemmConfig(64, 64, 128, num_warps=4, num_stages=3)
    return GemmConfig(128, 128, 64, num_warps=8, num_stages=3)


# int8_gemv_nk (session 16), int8 stored [N, K]: (BLOCK_N, BLOCK_K, warps) with BLOCK_K =
# 256 x warps, where x's load takes the layout its FMAs need (no shared memory; offline
# sm_90: 3.2-3.4 instructions per weight at one row, 40-127 registers). The weights are
# read as 2^15 + 128 + q, the bias off per word (``biased``): on the H200 this beat the
# exact conversion on every Llama-3-8B layer (59.4 against 62.9 us a layer; engine 2.62 ->
# 2.57 ms a step) for ~1e-4 of the output (session 17). Several row blocks per program in
# one stream never won, and went (docs/quantization.md, sessions 16-17).
NK = [
    GemmConfig(1, 8, 1024, 1, 4, 3, nk=True, biased=True),
    GemmConfig(1, 16, 1024, 1, 4, 3, nk=True, biased=True),
    GemmConfig(1, 4, 1024, 1, 4, 3, nk=True, biased=True),
    GemmConfig(1, 8, 2048, 1, 8, 3, nk=True, biased=True),
    GemmConfig(1, 16, 2048, 1, 8, 3, nk=True, biased=True),
]
NK_ROWS = [  # two or four rows of x per program (bucket 2-16)
    GemmConfig(1, 8, 1024, 1, 4, 3, nk=True, rows=2, biased=True),
    GemmConfig(1, 16, 1024, 1, 4, 3, nk=True, rows=2, biased=True),
    GemmConfig(1, 4, 1024, 1, 4, 3, nk=True, rows=4, biased=True),
    GemmConfig(1, 8, 1024, 1, 4, 3, nk=True, rows=4, biased=True),
]

# int4_gemv_nk (session 17), int4 stored [N, K / 8]: (BLOCK_N, BLOCK_K, warps) with BLOCK_K =
# 1,024 x warps (four words, 16 bytes, a thread). Offline sm_90 at one row: 2.8
# instructions per weight at 8 rows a program (72 registers), 2.5 at 16 (162), 3.5 at 4.
INT4_NK = [
    GemmConfig(1, 8, 4096, 1, 4, 3, nk=True),
    GemmConfig(1, 16, 4096, 1, 4, 3, nk=True),
    GemmConfig(1, 4, 4096, 1, 4, 3, nk=True),
    GemmConfig(1, 8, 2048, 1, 2, 3, nk=True),
    GemmConfig(1, 16, 2048, 1, 2, 3, nk=True),
    GemmConfig(1, 8, 8192, 1, 8, 3, nk=True),
]
# int4_gemv_mma (session 19), the same storage, groups of a multiple of 128: (BLOCK_N,
# BLOCK_K, warps), BLOCK_N rows in two halves, the warps along K (one element, 32 K, a
# thread). Offline sm_90 loop: 1.77 instructions per weight at 16 x 2048 / 2 (int4_gemv_nk
# 2.56). On the H200 (cold, us): qkv 6.8, o 5.6, gate/up 23.5, down 16.9 against
# int4_gemv_nk's 6.6, 5.4, 24.4, 16.8; the warps along N (32 x 1024 / 4, 16 x 1024 / 4)
# ran down in 33 us, and are not offered.
INT4_NK_MMA = [
    GemmConfig(1, 16, 4096, 1, 4, 3, nk=True, mma=True),
    GemmConfig(1, 16, 2048, 1, 2, 3, nk=True, mma=True),
    GemmConfig(1, 8, 4096, 1, 4, 3, nk=True, mma=True),
]
# int4_gemv_nk with its products on the integer unit (session 21, int4_dp4a_asm): x in
# 16-bit fixed point per 32 values, dp4a over bytes, exact sums. Offline sm_90 (whole
# kernel, K = 4,096 in one tile): 2.30 instructions a weight at 16 x 4096 / 4 against 3.06.
# Session 22 (K a constant, no masks where the tiles divide the layer, x in 16-byte loads):
# 1.86 at 16 x 4096 / 4 (96 registers, from 168), 1.54 at 32 x 4096 / 4 (177).
INT4_NK_DP4A = [
    GemmConfig(1, 8, 4096, 1, 4, 3, nk=True, dp4a=True),
    GemmConfig(1, 16, 4096, 1, 4, 3, nk=True, dp4a=True),
    GemmConfig(1, 16, 2048, 1, 2, 3, nk=True, dp4a=True),
    GemmConfig(1, 32, 4096, 1, 4, 3, nk=True, dp4a=True),
]
# Session 23, offered where 8,192 < K <= 16,384: a whole row in one tile over 16
# warps, no next tile held. Llama's down (K = 14,336) holds one at 16 x 4096 / 4: 255
# registers, two programs (8 warps) an SM. Offline: 128 registers at 16 rows (16 warps an
# SM), 64 at 8 (32).
INT4_NK_WIDE = [
    GemmConfig(1, 16, 16384, 1, 16, 3, nk=True, dp4a=True),
    GemmConfig(1, 8, 16384, 1, 16, 3, nk=True, dp4a=True),
]
# Session 20 (H200, cold us a Llama-3-8B layer; nk / mma / persistent grid / shared-memory
# ring): qkv 6.5 / 6.9 / 7.3 / 11.0, o 5.4 / 5.5 / 6.1 / 8.9, gate/up 24.3 / 23.6 / 24.5 /
# 32.4, down 16.6 / 16.7 / 16.8 / 25.3. Neither gained: the int4 one-row GEMV is not bound
# by bytes in flight either. Both were removed (kernels v16).
