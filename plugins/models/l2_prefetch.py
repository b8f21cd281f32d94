"""The next projection's weights into L2 while the decode attention runs (one-row decode).

At batch 1 a Llama step streams its weights at about the copy rate through the GEMVs, but
between the q/k/v GEMV and the gate/up GEMV the memory is mostly idle: the decode
attention, the o GEMV (8 MB at int4) and the add+norm are chains of short dependent steps
(session 27's int4 profile: 9.5 + 4.2 + 1.3 us a layer on the critical path, ~61 MB of
copy time, of which the o GEMV and the gate/up GEMV's first programs use a part). Here the
decode attention's programs, right after their PDL wait (the q/k/v GEMV's reads are done
then), ask L2 for a slice of the layer's gate/up weights with ``cp.async.bulk.prefetch``
(sm_90: one instruction a chunk, served by the copy engine of the SM, nothing to wait on),
so that the gate/up GEMV reads that slice from L2 instead of HBM.

The slice: ``TOKENLOOM_L2_PREFETCH_MB`` (0, the default: off) of the weight rows, from the
fraction ``TOKENLOOM_L2_PREFETCH_AT`` of each output half (gate and up: a program of the
SiLU GEMV reads row ``j`` of both), past the rows the GEMV's first programs load before
their own wait; ``TOKENLOOM_L2_PREFETCH_SCALES=1`` adds the int4 scales and zero points
(whole: they are ``[G, N]``, a row range of them is G pieces). A prefetch is a hint: the
results do not change, whatever L2 keeps.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator
from typing import Any

import torch
import triton
import triton.language as tl

MAX_REGIONS = 4
_REGIONS: contextvars.ContextVar[tuple[torch.Tensor, ...]] = contextvars.ContextVar(
    "tokenloom_l2_prefetch", default=()
)


def _settings() -> tuple[int, float, bool]:
    mb = float(os.environ.get("TOKENLOOM_L2_PREFETCH_MB", "0"))
    at = float(os.environ.get("TOKENLOOM_L2_PREFETCH_AT", "0.25"))
    scales = os.environ.get("TOKENLOOM_L2_PREFETCH_SCALES", "0") == "1"
    return int(mb * 2**20), at, scales


def row_regions(rows: torch.Tensor, parts: int, nbytes: int, at: float) -> list[torch.Tensor]:
    """Flat views of ``nbytes`` of the row-major weight ``rows [N, ...]``, split evenly over
    its ``parts`` output parts (each from row ``at`` of the part's rows)."""
    if rows.dim() != 2 or not rows.is_contiguous() or rows.shape[0] % parts:
        return []
    per_part = rows.shape[0] // parts
    row_bytes = rows.shape[1] * rows.element_size()
    first = min(int(at * per_part), per_part)
    count = min(nbytes // parts // row_bytes, per_part - first)
    if count <= 0:
        return []
    return [
        rows[p * per_part + first : p * per_part + first + count].view(-1) for p in range(parts)
    ]


def regions_of(linear: Any, nbytes: int, at: float, scales: bool) -> list[torch.Tensor]:
    """The slices of ``linear``'s weights to prefetch: the int4 kernel's packed rows
    (``[N, K / 8]`` storage) and optionally its scales and zero points, or a 16-bit
    layer's ``weight [N, K]``."""
    parts = len(linear.output_sizes)
    kernel = linear.kernel
    if kernel is None:
        weight = getattr(linear, "weight", None)
        return row_regions(weight, parts, nbytes, at) if weight is not None else []
    qweight = getattr(kernel, "qweight", None)
    if qweight is None or qweight.dtype != torch.int32 or not qweight.t().is_contiguous():
        return []  # only int4's row-major storage
    found = row_regions(qweight.t(), parts, nbytes, at)
    if scales and found:
        found += [t.view(-1) for t in (kernel.scales, kernel.zeros) if t is not None]
    return found[:MAX_REGIONS]


@contextlib.contextmanager
def during(linear: Any, tokens: int, device: torch.device) -> Iterator[None]:
    """Around the decode attention of a one-row step: its kernel prefetches ``linear``'s
    weights (the same layer's gate/up projection) into L2, when switched on."""
    nbytes, at, scales = _settings()
    regions: tuple[torch.Tensor, ...] = ()
    if nbytes > 0 and tokens == 1 and device.type == "cuda" and _supported(device):
        regions = tuple(regions_of(linear, nbytes, at, scales))
    token = _REGIONS.set(regions)
    try:
        yield
    finally:
        _REGIONS.reset(token)


def _supported(device: torch.device) -> bool:
    from tokenloom.plugins.models.pdl import pdl_on

    return pdl_on(device)  # sm_90 or later, compiled (not the interpreter)


def current() -> tuple[torch.Tensor, ...]:
    """The regions the decode attention launched now should prefetch (none: off)."""
    return _REGIONS.get()


def kernel_args(regions: tuple[torch.Tensor, ...], dummy: torch.Tensor) -> list[Any]:
    """``MAX_REGIONS`` pairs (tensor, bytes: a multiple of 16) for ``prefetch``; unused
    pairs point at ``dummy`` with 0 bytes."""
    args: list[Any] = []
    for t in regions[:MAX_REGIONS]:
        args += [t, (t.numel() * t.element_size()) // 16 * 16]
    for _ in range(MAX_REGIONS - len(regions[:MAX_REGIONS])):
        args += [dummy, 0]
    return args


_BULK_PREFETCH = tl.constexpr(
    "{ .reg .pred p; setp.ne.u32 p, $2, 0; "
    "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }"
)


@triton.jit
def _region(ptr, nbytes, program, programs, THREADS: tl.constexpr):
    """This program's share of one region: a chunk a warp (a multiple of 16 bytes), issued
    by its first lane (the instruction takes one warp-uniform address: ptxas loops over
    the lanes with distinct ones, so only one lane a warp issues)."""
    WARPS: tl.constexpr = THREADS // 32
    step = programs * WARPS * 16
    per = (nbytes + step - 1) // step * 16
    t = tl.arange(0, THREADS)
    start = (program * WARPS + t // 32).to(tl.int64) * per
    size = tl.minimum(tl.maximum(nbytes - start, 0), per).to(tl.int32)
    size = tl.where(t % 32 == 0, size, 0)
    addr = ptr.to(tl.pointer_type(tl.int8)) + start
    tl.inline_asm_elementwise(
        _BULK_PREFETCH, "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def prefetch(p0, n0, p1, n1, p2, n2, p3, n3, program, programs, THREADS: tl.constexpr):
    """Issue this program's part of the L2 prefetch of up to four regions (CUDA, sm_90);
    ``THREADS`` must be the program's thread count (a chunk a warp, none repeated)."""
    _region(p0, n0, program, programs, THREADS)
    _region(p1, n1, program, programs, THREADS)
    _region(p2, n2, program, programs, THREADS)
    _region(p3, n3, program, programs, THREADS)
