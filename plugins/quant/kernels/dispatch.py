"""Which tiling of the weight GEMM each quantized layer runs, per batch-size bucket.

On the GPU the candidates of each bucket are measured once per weight shape and
format (replayed in a CUDA graph, as decode runs) after a check against the
dequantized reference, and the fastest correct one is kept; a candidate that fails to
compile or disagrees is skipped, so a tiling that one GPU or Triton release handles
badly costs nothing. Choices are remembered per GPU model, versions, shape and format
in ``$TOKENLOOM_CACHE/weight-gemm.json`` (and for the process), so a setup always
runs the same kernels. Off the GPU the fixed heuristic of ``choose_config`` serves.
What is offered to each bucket: ``offered.py`` (its names are re-exported here).
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
from tokenloom.plugins.quant.kernels.int4_tiles import int4_row_major
from tokenloom.plugins.quant.kernels.int8_gemv_nk import row_major
from tokenloom.plugins.quant.kernels.offered import (  # noqa: F401  (re-exported)
    BUCKETS,
    DEQUANT,
    DEQUANT_MAX_ELEMENTS,
    GEMV,
    GEMV_ROWS,
    H2,
    INT4_NK,
    INT4_NK_DP4A,
    INT4_NK_MMA,
    INT4_NK_WIDE,
    KMAJOR_LARGE,
    KMAJOR_MEDIUM,
    KMAJOR_SKINNY,
    LARGE,
    MEDIUM,
    NK,
    NK_ROWS,
    SKINNY,
    SPLIT_BYTES,
    bucket,
    candidates,
    dequant_offered,
    exact_for_fractional_zeros,
    h2_candidates,
)
from tokenloom.plugins.quant.kernels.weight_gemm import GemmConfig, choose_config, weight_gemm

log = logging.getLogger("tokenloom.quant")

Configs = tuple[GemmConfig, ...]  # one per bucket
_DECIDED: dict[str, Configs] = {}


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
