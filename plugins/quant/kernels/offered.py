"""The tilings the weight tuner offers each quantized layer (``candidates``, per batch-size
bucket), and the buckets themselves; ``dispatch`` measures them and keeps the fastest.
Each list says which kernel of ``weight_gemm`` it runs and what was measured when it was
added (docs/quantization.md). A change here is a change of the tuner's choices: bump
``dispatch.KERNELS_VERSION``."""

from __future__ import annotations

import os
from dataclasses import asdict, replace

import torch
import triton

from tokenloom.plugins.quant.kernels.int4_gemv_h2 import h2_offered
from tokenloom.plugins.quant.kernels.weight_gemm import SKINNY_ROWS, GemmConfig

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

# (largest row count of the bucket, row counts measured for it)
# The decode batches of a busy server (65-256 rows) have their own bucket: the tiling
# measured at 512 rows (one wave of 128x128 tiles) left most SMs idle at 128 rows on
# the narrow layers.
BUCKETS = (
    (1, (1,)),
    (SKINNY_ROWS, (2, SKINNY_ROWS)),
    (64, (64,)),
    (256, (128, 256)),
    (None, (512,)),
)

SKINNY = [
    GemmConfig(16, 32, 256, 1, 4, 4),
    GemmConfig(16, 64, 256, 1, 4, 4),
    GemmConfig(16, 32, 128, 1, 4, 4),
    GemmConfig(16, 16, 256, 1, 4, 4),
    GemmConfig(16, 32, 256, 1, 4, 4, expand=False),
]
GEMV = [  # weight_gemv tilings (block_m unused): int4, those that nest with its groups
    GemmConfig(1, 64, 128, 1, 4, 3, gemv=True),
    GemmConfig(1, 32, 128, 1, 4, 4, gemv=True),
    GemmConfig(1, 128, 128, 1, 4, 3, gemv=True),
    GemmConfig(1, 64, 64, 1, 4, 4, gemv=True),
    GemmConfig(1, 64, 256, 1, 4, 3, gemv=True),
    GemmConfig(1, 32, 256, 1, 4, 3, gemv=True),
    GemmConfig(1, 128, 64, 1, 4, 4, gemv=True),
    GemmConfig(1, 256, 128, 1, 8, 3, gemv=True),
    GemmConfig(1, 128, 128, 1, 8, 3, gemv=True),
    GemmConfig(1, 256, 64, 1, 4, 3, gemv=True),
    GemmConfig(1, 128, 256, 1, 8, 3, gemv=True),  # added for int8's [K, N] GEMV (session 15)
]
GEMV_ROWS = [  # two or four rows per program (bucket 2-16): the weights are read once for all
    GemmConfig(1, 64, 128, 1, 4, 3, gemv=True, rows=4),
    GemmConfig(1, 64, 64, 1, 4, 3, gemv=True, rows=4),
    GemmConfig(1, 128, 64, 1, 8, 3, gemv=True, rows=4),
    GemmConfig(1, 64, 128, 1, 4, 3, gemv=True, rows=2),
    GemmConfig(1, 128, 128, 1, 8, 3, gemv=True, rows=2),
]
# int4_gemv_h2: the tilings that measured best per Llama-3-8B layer (session
# 13, one H200: 64 x 128 with 2 warps on qkv and gate_up, 128 x 128 with 8 on o and down)
H2 = [
    GemmConfig(1, 64, 128, 1, 2, 3, h2=True),
    GemmConfig(1, 128, 128, 1, 4, 3, h2=True),
    GemmConfig(1, 128, 128, 1, 8, 3, h2=True),
    GemmConfig(1, 64, 128, 1, 4, 3, h2=True),
]


def h2_candidates(n: int, k: int, bits: int, group: int, has_zeros: bool, dtype) -> list:
    """``H2`` with K split 1-16 (each split two tiles at least), where ``int4_gemv_h2``
    serves the format (int4 with zero points, bf16) and the tuner may offer it
    (``h2_offered``); none for int8 (no GEMV over ``[K, N]`` since kernels v14)."""
    if not (bits == 4 and has_zeros and h2_offered() and dtype == torch.bfloat16):
        return []
    return [
        replace(cfg, split_k=split)
        for cfg in H2
        if cfg.fits(bits, group)
        for split in (1, 2, 4, 8, 16)
        if split == 1 or (split * 2 <= k // cfg.block_k and (k // cfg.block_k) % split == 0)
    ]


MEDIUM = [
    GemmConfig(64, 64, 128, 1, 4, 3),
    GemmConfig(32, 64, 128, 1, 4, 3),
    GemmConfig(64, 128, 64, 1, 4, 3),
    GemmConfig(64, 64, 128, 1, 4, 3, expand=False),
]
LARGE = [
    GemmConfig(128, 128, 64, 1, 8, 3),
    GemmConfig(128, 128, 64, 1, 4, 4),
    GemmConfig(128, 256, 64, 1, 8, 3),
    GemmConfig(64, 128, 128, 1, 4, 3),
    GemmConfig(128, 128, 64, 1, 8, 3, expand=False),
]

# int4 in one group per tile: the tile dequantized [N, K] (16-byte shared-memory
# stores, two values per instruction in PTX on sm_90; weight_gemm's KMAJOR)
# ... and with the product transposed (``swap``): the dequantized tile feeds the MMA from
# registers and the batch is the MMA's N (16 rows and up), so it serves decode too
KMAJOR_SKINNY = [
    GemmConfig(16, 128, 128, 1, 4, 3, kmajor=True, swap=True),
    GemmConfig(16, 64, 128, 1, 4, 3, kmajor=True, swap=True),
    GemmConfig(16, 128, 64, 1, 4, 4, kmajor=True, swap=True),
]
KMAJOR_MEDIUM = [
    GemmConfig(32, 128, 128, 1, 4, 3, kmajor=True, swap=True),
    GemmConfig(64, 128, 64, 1, 4, 3, kmajor=True, swap=True),
    GemmConfig(64, 64, 128, 1, 4, 3, kmajor=True, swap=True),
    GemmConfig(64, 64, 128, 1, 4, 3, kmajor=True),
    GemmConfig(32, 64, 128, 1, 4, 3, kmajor=True),
    GemmConfig(64, 128, 64, 1, 4, 3, kmajor=True),
    GemmConfig(64, 128, 128, 1, 4, 3, kmajor=True),
]
KMAJOR_LARGE = [
    GemmConfig(64, 128, 64, 1, 4, 3, kmajor=True, swap=True),
    GemmConfig(128, 128, 64, 1, 8, 3, kmajor=True, swap=True),
    GemmConfig(128, 128, 128, 1, 8, 2, kmajor=True, swap=True),
    GemmConfig(64, 256, 64, 1, 8, 3, kmajor=True, swap=True),
    GemmConfig(128, 128, 64, 1, 8, 3, kmajor=True),
    GemmConfig(128, 128, 128, 1, 8, 2, kmajor=True),
    GemmConfig(128, 256, 64, 1, 8, 3, kmajor=True),
    GemmConfig(64, 128, 128, 1, 4, 3, kmajor=True),
    GemmConfig(64, 64, 128, 1, 4, 3, kmajor=True),
]


def bucket(m: int) -> int:
    for index, (top, _) in enumerate(BUCKETS):
        if top is None or m <= top:
            return index
    raise AssertionError("the last bucket is open")


# The most fp32 partial sums a K split may write per call (split x rows x N x 4 bytes):
# a 256-row split of 64 over Llama-3-8B's down projection wrote 224 MiB for a 2 MiB output.
SPLIT_BYTES = 32 << 20


def _with_split(cfg: GemmConfig, n: int, k: int, num_sms: int, rows: int) -> list[GemmConfig]:
    """A tiling alone and with each power-of-two K split that keeps at most eight
    programs per multiprocessor, two K tiles per split and ``SPLIT_BYTES`` of partial
    sums at ``rows``: at few rows a program holds a few KiB in flight, so more of them
    cover more memory latency."""
    configs = [cfg]
    tiles = triton.cdiv(n, cfg.block_n)
    if not cfg.gemv:  # the dot kernels' row tiles (the GEMV's splits as measured in session 7)
        tiles *= triton.cdiv(rows, cfg.block_m)
    k_tiles = triton.cdiv(k, cfg.block_k)
    split = 2
    while (
        tiles * split <= 8 * num_sms
        and split * 2 <= k_tiles
        and split * rows * n * 4 <= SPLIT_BYTES
    ):
        configs.append(GemmConfig(**{**asdict(cfg), "split_k": split}))
        split *= 2
    return configs


def exact_for_fractional_zeros(cfg: GemmConfig) -> bool:
    """Whether a tiling computes ``(q - z) s`` exactly for a zero point that is no
    integer (a GGUF Q4_1 file's ``-m / d``): the GEMVs and the gather tiles do; the
    expanded, K-major and whole-weight dequantization tiles fold ``z`` into the 2^23
    conversion constant, which rounds it to an integer. int4_gemv_nk takes ``z`` in its
    fp32 epilogue."""
    return cfg.gemv or cfg.nk or not (cfg.expand or cfg.kmajor or cfg.dequant)


def candidates(
    index: int,
    n: int,
    k: int,
    bits: int,
    group: int,
    num_sms: int,
    fractional: bool = False,
    nk: bool = False,
):
    """The tilings offered to bucket ``index``; ``nk``: stored ``[N, K]`` (the GEMVs over
    ``[K, N]`` give way to ``int8_gemv_nk``, or ``int4_gemv_nk`` at one row; the dot tiles
    read the strides). int8 stored ``[K, N]`` (not the engine's) gets no GEMV: the GEMV
    tilings do not fit it (``gemv_fits``)."""
    gemv, gemv_rows = (NK, NK_ROWS) if nk else (GEMV, GEMV_ROWS)
    if nk and bits == 4:
        wide = INT4_NK_WIDE if 8192 < k <= 16384 else []  # one tile a row
        gemv, gemv_rows = (INT4_NK + INT4_NK_MMA + INT4_NK_DP4A + wide if index == 0 else []), []
    pools = (
        gemv + SKINNY + KMAJOR_SKINNY,
        gemv + gemv_rows + SKINNY + KMAJOR_SKINNY,
        MEDIUM + KMAJOR_MEDIUM,
        LARGE + MEDIUM + KMAJOR_LARGE,
        LARGE + KMAJOR_LARGE,
    )
    result: list[GemmConfig] = []
    for cfg in pools[index]:
        # split K where a layer has few column tiles: for decode batches, and up to 256
        # rows (64 rows of Llama-3-8B's down projection ran 64 programs on 132 SMs);
        # int4's N-major tiles never won there, so they are not offered split (each
        # candidate costs start-up time once per shape)
        if cfg.nk:  # whole rows per program: never split
            result.append(cfg)
        elif index <= 1 or (index <= 3 and (cfg.kmajor or bits == 8)):
            result += _with_split(cfg, n, k, num_sms, max(BUCKETS[index][1]))
        else:
            result.append(cfg)
    if index == len(BUCKETS) - 1 and dequant_offered() and n * k <= DEQUANT_MAX_ELEMENTS:
        result.append(DEQUANT)
    return [
        c
        for c in result
        if c.fits(bits, group)
        and (bits == 4 or c.expand)
        and (not fractional or exact_for_fractional_zeros(c))
    ]


# The whole weight dequantized into a 16-bit scratch buffer, then cuBLAS: for prefill
# chunks, where cuBLAS at 16 bits ran the Llama-3-8B layers in about half the time of
# the per-tile kernels at 1,024 rows. Offered to the largest bucket only; on by default
# since it was measured (session 10, one H200: llama-3-8b offline throughput int4
# 7,236 -> 8,269, int8 7,308 -> 8,345 out tok/s); TOKENLOOM_WEIGHT_DEQUANT=0 turns it off.
DEQUANT = GemmConfig(0, 0, 0, dequant=True)
# not for layers far above a decoder layer's size (an LM head of 128k x 4,096 would hold
# 1 GB of scratch for one eager GEMM per prefill)
DEQUANT_MAX_ELEMENTS = 1 << 28


def dequant_offered() -> bool:
    return os.environ.get("TOKENLOOM_WEIGHT_DEQUANT", "1") != "0"
