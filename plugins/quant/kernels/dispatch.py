"""Which tiling of the weight GEMM each quantized layer runs, per batch-size bucket.

On the GPU the candidates of each bucket are measured once per weight shape and
format (replayed in a CUDA graph, as decode runs) after a check against the
dequantized reference, and the fastest correct one is kept; a candidate that fails to
compile or disagrees is skipped, so a tiling that one GPU or Triton release handles
badly costs nothing. Choices are remembered per GPU model, versions, shape and format
in ``$TOKENLOOM_CACHE/weight-gemm.json`` (and for the process), so a setup always
runs the same kernels. Off the GPU the fixed heuristic of ``choose_config`` serves.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

import torch
import triton

from tokenloom.plugins.models import tuning_cache
from tokenloom.plugins.quant.kernels.gemm_config import (  # noqa: F401  (re-exported)
    INT4_NK,
    INT4_NK_DP4A,
    INT4_NK_MMA,
    INT4_NK_WIDE,
    NK,
    NK_ROWS,
)
from tokenloom.plugins.quant.kernels.int4_gemv_h2 import h2_offered
from tokenloom.plugins.quant.kernels.int4_tiles import int4_row_major
from tokenloom.plugins.quant.kernels.int8_gemv_nk import row_major
from tokenloom.plugins.quant.kernels.weight_gemm import (
    SKINNY_ROWS,
    GemmConfig,
    choose_config,
    weight_gemm,
)

log = logging.getLogger("tokenloom.quant")

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

Configs = tuple[GemmConfig, ...]  # one per bucket
_DECIDED: dict[str, Configs] = {}


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


def tune_cold() -> bool:
    """``TOKENLOOM_TUNE_COLD=1`` (unmeasured, session 20): each candidate timed over copies
    of the weights (``COLD_BYTES`` in all) read from HBM, as in a decode step. Hot, qkv, o
    and down stay in an H200's 50 MB L2, and int4 down's choice moved between starts
    (int4_gemv_mma, 18.7 us on the step's critical path; int4_gemv_nk, 16.9)."""
    return os.environ.get("TOKENLOOM_TUNE_COLD", "0") == "1"


COLD_BYTES = 150 << 20  # 3x an H200's L2
CACHE_NAME = "weight-gemm.json"
# Part of every cache key: bump it when a kernel, the buckets or the candidate lists
# change, so that no machine keeps a choice measured on code that is gone.
# v2-v5 (session 7-9): buckets 1 / 16 / 64 / 65-256 / any; the one-row GEMV (weight_gemv),
# its shift-free nibbles, prefetch and rows per program; the int4 dot kernel's 2^23
# conversion and K-major tile (PTX dequantization), also swapped.
# v6: the swapped tiles from 1 row, K split up to 256 rows; v7: the one-row GEMV's PTX
# conversions; v8: it sums its K splits itself; v9: groups smaller than the GEMVs' tile.
# v10: int4_gemv_h2 offered by default, with K split up to 16 (its best tiling in session
# 13 was the largest split offered, 8, on every layer).
# v11: the int8 one-row GEMV's four sub-tiles share their accumulators (96 -> 64 registers
# at 64 x 128), x one tile ahead; a 128 x 256 GEMV tiling with 8 warps; int8_gemv_h2.
# v12: int8 stored [N, K] (int8_gemv_nk at one to sixteen rows; the dot tiles by strides).
# v13: int8_gemv_nk offers its biased conversion only; no row blocks per program; int4
# stored [N, K / 8] (int4_gemv_nk at one row; the dot tiles and dequantization by strides).
# v14: int4 stored [N, K / 8] only where int4_gemv_nk serves the layer (bf16, sm_90+); a
# rerouted call over that storage takes the gather tile (exact for fractional zero points);
# the int8 GEMVs over [K, N] removed.
# v15: int4_gemv_mma (the one-row int4 GEMV on the tensor cores) offered; v16: its ring and
# persistent grid removed (stored choices named fields that are gone).
# v17: int4_gemv_nk's integer products (dp4a) offered; a one-tile row holds no next tile.
# v18: int4_gemv_nk with K a constant and unmasked even tiles; dp4a at 32 rows offered.
# v19: int4_gemv_nk: whole rows of 8,192 < K <= 16,384 over 16 warps; SiLU fused.
KERNELS_VERSION = 19


def _load() -> dict[str, Any]:
    return tuning_cache.load(CACHE_NAME)


def _store(key: str, configs: Configs) -> None:
    tuning_cache.store(CACHE_NAME, key, [asdict(c) for c in configs])


def _stored_nk(qweight: torch.Tensor, bits: int) -> bool:
    return row_major(qweight) if bits == 8 else int4_row_major(qweight)


def choose_configs(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bits: int,
    group: int,
    dtype: torch.dtype,
    reference: Callable[[torch.Tensor], torch.Tensor],
) -> Configs:
    """The tiling of each bucket for this layer (see the module docstring);
    ``reference(x)`` is the dequantized layer, the candidates' oracle."""
    n = qweight.shape[1]
    k = qweight.shape[0] * (8 if bits == 4 else 1)
    device = qweight.device
    if device.type != "cuda":
        return tuple(choose_config(m[-1], n, k, 4) for _, m in BUCKETS)  # type: ignore[return-value]
    fractional = zeros is not None and bool((zeros != zeros.round()).any())
    nk = _stored_nk(qweight, bits)
    h2 = [] if nk else h2_candidates(n, k, bits, group, zeros is not None, dtype)
    key = (
        f"{torch.cuda.get_device_name(device)}|torch {torch.__version__}|"
        f"triton {triton.__version__}|int{bits} g{group}|{n}x{k}|{dtype}|zeros {zeros is not None}"
        f"{' fractional' if fractional else ''}"
        f"|kernels v{KERNELS_VERSION}{' dequant' if dequant_offered() else ''}"
        f"{' h2' if h2 else ''}{' nk' if nk else ''}{' cold' if tune_cold() else ''}"
    )
    if key not in _DECIDED:
        stored = _load().get(key)
        if stored and len(stored) == len(BUCKETS):
            _DECIDED[key] = tuple(GemmConfig(**c) for c in stored)  # type: ignore[assignment]
        else:
            _DECIDED[key] = _measure(
                qweight, scales, zeros, bits, group, dtype, reference, fractional
            )
            _store(key, _DECIDED[key])
    if any(c.dequant for c in _DECIDED[key]):  # its buffer now, never inside a graph capture
        from tokenloom.plugins.quant.kernels.dequant import reserve

        reserve(n * k, dtype, device)
    return _DECIDED[key]


@torch.inference_mode()
def _measure(qweight, scales, zeros, bits, group, dtype, reference, fractional=False) -> Configs:
    from tokenloom.plugins.models.cuda_timing import time_graph

    n = qweight.shape[1]
    k = qweight.shape[0] * (8 if bits == 4 else 1)
    num_sms = torch.cuda.get_device_properties(qweight.device).multi_processor_count
    chosen: list[GemmConfig] = []
    copies = [(qweight, scales, zeros)]
    if tune_cold():  # clones keep the strides ([N, K / 8] storage stays so)
        nbytes = sum(t.nbytes for t in (qweight, scales, zeros) if t is not None)
        copies += [
            (qweight.clone(), scales.clone(), None if zeros is None else zeros.clone())
            for _ in range(-(-COLD_BYTES // nbytes) - 1)
        ]
    for index, (_, rows) in enumerate(BUCKETS):
        xs = [torch.randn(m, k, dtype=dtype, device=qweight.device) for m in rows]
        expected = [reference(x).float() for x in xs]
        best, best_time = choose_config(rows[-1], n, k, num_sms), float("inf")
        if fractional:  # the fallback, too, must take the zero points as they are
            best = replace(best, expand=False)
        nk = _stored_nk(qweight, bits)
        offered = candidates(index, n, k, bits, group, num_sms, fractional, nk)
        if index == 0 and not nk:
            offered += h2_candidates(n, k, bits, group, zeros is not None, dtype)
        for cfg in offered:
            try:
                for x, ref in zip(xs, expected, strict=True):
                    y = weight_gemm(x, qweight, scales, zeros, bits, group, None, cfg).float()
                    if float((y - ref).norm() / ref.norm()) > 2e-2:
                        raise ValueError("disagrees with the dequantized reference")
                t = sum(
                    time_graph(
                        lambda x=x, c=cfg: [
                            weight_gemm(x, q_, s_, z_, bits, group, None, c)
                            for q_, s_, z_ in copies
                        ]
                    )
                    for x in xs
                ) / len(copies)
            except Exception as err:  # a tile this GPU or Triton cannot run
                log.debug("weight GEMM %s skipped on %dx%d: %s", cfg, n, k, err)
                continue
            if t < best_time:
                best, best_time = cfg, t
        log.info("int%d %dx%d rows %s: %s %.1f us", bits, n, k, rows, best, best_time)
        chosen.append(best)
    from tokenloom.plugins.quant.kernels.dequant import release

    release(dtype, qweight.device)  # measuring grew it; choose_configs reserves it if chosen
    return tuple(chosen)  # type: ignore[return-value]
