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
