"""``weight_gemm``: the product of every weight-only quantized linear, ``y = x @ W^T
(+ bias)`` with ``W`` int8 (W8A16) or packed int4 (W4A16), dispatched over the kernels
that serve its shape and storage (the layouts and scales: ``gemm_tile``).

Shapes: small batches (``M <= 16``, decode) are a pure weight stream. There, and up
to 256 rows, the grid may also split ``K`` (``split_k`` programs per output tile, fp32
partial sums added by one small reduction, ``gemm_tile.split_sum``) so that narrow
layers still put enough programs on the GPU. A config (``gemm_config.choose_config``,
or the layer's tuned one) picks the kernel: the dot tile (``gemm_tile``); with ``gemv``
``weight_gemv``'s FMA kernel (int4, one row or a few: no ``tl.dot``); with ``h2``
``int4_gemv_h2``; with ``nk`` the kernels over ``[N, K']`` storage (``int8_gemv_nk``,
``int4_gemv_nk``, ``int4_gemv_mma``); with ``dequant`` the whole weight dequantized
(``dequant.py``) and cuBLAS. A config a format cannot take falls back to one it can.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache

import torch
import triton

from tokenloom.plugins.quant.kernels.gemm_config import (  # noqa: F401  (re-exported)
    SKINNY_ROWS,
    GemmConfig,
    choose_config,
)
from tokenloom.plugins.quant.kernels.gemm_tile import launch_gemm, split_sum
from tokenloom.plugins.quant.kernels.int4_gemv_h2 import h2_fits, launch_h2
from tokenloom.plugins.quant.kernels.int4_gemv_mma import launch_int4_mma
from tokenloom.plugins.quant.kernels.int4_gemv_nk import int4_nk_fits, launch_int4_nk
from tokenloom.plugins.quant.kernels.int4_tiles import int4_row_major
from tokenloom.plugins.quant.kernels.int8_gemv_nk import launch_int8_nk, nk_fits, row_major
from tokenloom.plugins.quant.kernels.weight_gemv import gemv_fits, launch_gemv, reduce_counters


@cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def weight_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bits: int,
    group: int,
    bias: torch.Tensor | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """``x [M, K] @ dequant(qweight)^T (+ bias) -> [M, N]`` in ``x``'s dtype.

    ``qweight [K / (32 // bits) or K, N]`` (int32 packed for 4 bits, int8 for 8),
    ``scales [1 or G, N]``, ``zeros`` None or ``[G, N]``; ``group`` 0 means per
    channel. ``x``'s last dim must be contiguous. int8 weights may be stored ``[N, K]``
    (``qweight`` the transposed view, as ``quantize_int8`` returns it): the dot tiles and
    the dequantization read them through their strides, one to four rows run
    ``int8_gemv_nk``. int8 has no GEMV over ``[K, N]``: a GEMV or h2 tiling gives way to
    ``int8_gemv_nk`` or a dot tile (``choose_config``). int4 weights may be stored
    ``[N, K / 8]`` (``int4_row_major``) too: one row runs ``int4_gemv_nk``, and a GEMV or
    h2 tiling (over ``[K / 8, N]``) gives way to a dot tile."""
    m, k = x.shape
    n = qweight.shape[1]
    assert bits in (4, 8) and x.stride(1) == 1
    nk = bits == 8 and row_major(qweight)
    nk_ok = nk and group == 0 and nk_fits(x, qweight)  # int8_gemv_nk can serve this call
    row4 = bits == 4 and int4_row_major(qweight)  # int4 stored [N, K / 8]
    nk4_ok = row4 and int4_nk_fits(x, qweight, group, zeros is not None)
    # the kernels index the weights as dense [K', N] rows, or [N, K'] ones (a strided
    # view read as one gave wrong outputs silently)
    assert qweight.is_contiguous() or nk or row4, "weights must be contiguous (or [N, K'])"
    assert scales.is_contiguous(), "scales must be contiguous"
    assert qweight.shape[0] * (8 if bits == 4 else 1) == k, (tuple(qweight.shape), k)

    def fallback(nk_ok: bool = nk_ok, gather: bool = False) -> GemmConfig:
        """``choose_config``'s tiling; where the dot tile must gather (``gather``, or
        groups that do not nest with its K), 64 K deep and 3 stages at most (256 x 4
        stages: 483 KB of shared memory in bf16, 704 KB in fp32)."""
        chosen = choose_config(m, n, k, _num_sms(x.device), nk_ok)
        if gather or (bits == 4 and not chosen.nk and not chosen.fits(bits, group)):
            chosen = replace(chosen, expand=False, block_k=min(chosen.block_k, 64), num_stages=3)
        return chosen

    cfg = config or fallback()
    # the GEMVs over [K', N] would read [N, K'] storage wrongly: a kernel for this layout
    # (int4: the dot tile's gather path, which serves any group, a partial last one, and
    # zero points that are no integers, as int4_gemv_nk and the GEMVs do)
    if ((nk or row4) and (cfg.gemv or cfg.h2)) or (
        cfg.nk and not ((nk_ok or nk4_ok) and cfg.fits(bits, group))
    ):
        cfg = fallback(gather=row4)
    if cfg.dequant and cfg.fits(bits, group):
        from tokenloom.plugins.quant.kernels.dequant import dequantize_into

        w = dequantize_into(qweight, scales, zeros, bits, group, x.dtype)
        return torch.nn.functional.linear(x, w, bias)
    if cfg.dequant:  # a format the whole-weight path cannot serve
        cfg = fallback()
    if cfg.gemv and not gemv_fits(bits, group, cfg.block_k, zeros is not None, cfg.rows):
        cfg = fallback()  # a format the GEMV cannot serve
    if cfg.h2 and not h2_fits(x, bits, group, cfg.block_k, zeros is not None):
        cfg = fallback(False)
    if cfg.nk and bits == 4:
        extra = {} if cfg.mma else {"dp4a": cfg.dp4a}
        return (launch_int4_mma if cfg.mma else launch_int4_nk)(
            x, qweight, scales, zeros, group, bias, cfg.block_n, cfg.block_k, cfg.num_warps, **extra
        )  # type: ignore[arg-type]
    if cfg.nk:
        return launch_int8_nk(
            x, qweight, scales, bias, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.rows, cfg.biased
        )
    k_chunk = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_chunk)
    if split == 1:
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    else:
        y = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    if cfg.gemv or cfg.h2:
        # the one-row GEMV sums its splits itself where it can (no second launch)
        one_row = cfg.rows == 1 or m == 1  # the kernel that can
        counters = (
            reduce_counters(x.device, triton.cdiv(n, cfg.block_n) * m)
            if split > 1 and one_row
            else None
        )
        reduced_out = (
            torch.empty(m, n, dtype=x.dtype, device=x.device) if counters is not None else None
        )
        launch = launch_h2 if cfg.h2 else launch_gemv
        reduced = launch(
            x,
            qweight,
            scales,
            zeros,
            bits,
            group,
            bias,
            y,
            m,
            n,
            k,
            k_chunk,
            split,
            cfg,
            out=reduced_out,
            counters=counters,
        )
        if reduced:
            assert reduced_out is not None
            return reduced_out
    else:
        launch_gemm(x, qweight, scales, zeros, bits, group, bias, y, m, n, k, k_chunk, split, cfg)
    if split == 1:
        return y
    return split_sum(y, bias, torch.empty(m, n, dtype=x.dtype, device=x.device))
