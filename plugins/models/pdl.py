"""Programmatic dependent launch (PDL, CUDA on sm_90 and later) for the decode path's
Triton kernels.

A kernel launched with PDL may start while the kernel before it in the stream is still
running: as soon as every program of that kernel has called ``release`` (or exited).
Its programs then sit on free SM slots and do what depends on no earlier kernel (a
GEMV streams its first weight tile) until ``wait`` returns, which is when the earlier
kernel has finished and its writes are visible. At batch 1 the kernels are short (a
few microseconds each, ~290 per Llama-3-8B step), so each one's launch latency and
ramp-up, otherwise serial, overlap the previous one's tail.

The contract of a kernel that takes part (a ``USE_PDL`` constexpr):
- ``wait(USE_PDL)`` before its first load of anything an earlier kernel may write
  (activations, metadata, counters, caches) and before its first store (a buffer it
  writes may still be read by the kernel before it). Only weights, which no kernel of
  a step writes, may be read before it.
- no ``return`` before the wait (a program that exits counts as released).
- ``release(USE_PDL)`` after the wait: it only lets the next kernel start; that kernel
  waits for this one to finish before it reads. Releasing after the wait means that
  when a kernel starts, every kernel but the one before it has finished, so what those
  wrote may be read before the wait too: the decode attention reads its first KV tile
  there, all but the token the kernel before it writes (``decode_tile.py``).
  ``tests/plugins/models/test_pdl.py`` checks every kernel's order. The exceptions,
  ``release_early``: the RMSNorm kernel's (its successor is a projection, which reads
  nothing but weights before its wait, so it may start during the GEMV before the norm)
  and the o projection's one-row GEMV (``next_reads_weights_first``: the add+norm
  follows, so the norm and the gate/up GEMV start during the attention; int4 1.709 ->
  1.685 ms a step on an H200, on by default since session 27).
A kernel without the flag (torch's, cuBLAS's) runs as before; a PDL kernel after it
starts when it ends. CUDA-graph capture records the launches as programmatic edges.

Measured (session 11, one H200, `bench latency --model llama-3-8b`, same machine start,
``TOKENLOOM_PDL=0`` against the default): int4 2.94 -> 2.72 ms per step, fp8 3.84 ->
3.53, bf16 4.55 -> 4.54 (its GEMMs are cuBLAS's, which take no part), qwen3-0.6b 1.21
-> 1.19; offline throughput bf16 9,730 -> 9,734 out tok/s.

``TOKENLOOM_PDL=0`` turns it off (read once); on the CPU (the interpreter) and before
sm_90 it is always off.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Iterator
from typing import Any

import torch
import triton
import triton.language as tl

ENABLED = os.environ.get("TOKENLOOM_PDL", "1") != "0"
_NEXT_READS_WEIGHTS = contextvars.ContextVar("tokenloom_pdl_next_reads_weights", default=False)


@contextlib.contextmanager
def next_reads_weights_first() -> Iterator[None]:
    """Around a projection whose next kernel reads only weights before its wait (the
    attention's o projection: the add+norm follows it): the projection's one-row GEMV
    (``int4_gemv_nk``, ``int8_gemv_nk`` at one row of x, bf16's ``skinny_gemm.gemv``)
    then releases before its wait
    (``release_early``), so the norm, and through its own early release the gate/up GEMV,
    start during the decode attention and stream their first weight tiles there.
    On by default since session 27, when its GPU tests (``test_pdl.py``: the chain with
    both GEMVs releasing early, an int4 model's tokens with and without it) passed on an
    H200; int4 1.709 -> 1.685 ms a step there. ``TOKENLOOM_O_EARLY_RELEASE=0`` (read at
    each use) turns it off."""
    token = _NEXT_READS_WEIGHTS.set(os.environ.get("TOKENLOOM_O_EARLY_RELEASE", "1") == "1")
    try:
        yield
    finally:
        _NEXT_READS_WEIGHTS.reset(token)


def early_release() -> bool:
    """Whether the GEMV launched now may release early (``next_reads_weights_first``)."""
    return _NEXT_READS_WEIGHTS.get()


@functools.cache
def _supported(index: int) -> bool:
    # NVIDIA only: ROCm reports its GPUs as "cuda" devices, with capabilities of 9 too
    return torch.version.cuda is not None and torch.cuda.get_device_capability(index)[0] >= 9


def pdl_on(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL."""
    if not ENABLED or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(device: torch.device) -> dict[str, Any]:
    """The launch keywords of a PDL kernel on ``device``: ``USE_PDL`` (the kernel's
    constexpr) and Triton's ``launch_pdl``."""
    if pdl_on(device):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}


@triton.jit
def wait(USE_PDL: tl.constexpr):
    """Block until the kernels before this one have finished (a no-op without PDL)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def release(USE_PDL: tl.constexpr):
    """Let the next kernel in the stream start (a no-op without PDL)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def release_early(USE_PDL: tl.constexpr):
    """``release`` before the wait: the next kernel may start while the one before this
    one still runs. Only where the successor reads nothing but weights before its own
    wait (never the decode attention, which relies on the kernel before it releasing
    after its wait): the RMSNorm kernel (``fused_ops._add_rms_norm_kernel``) and
    act-order's gather (``fused_ops.gather_columns``), whose successor is always a
    projection, and the one-row GEMVs under
    ``next_reads_weights_first`` (the o projection, followed by the add+norm);
    ``tests/plugins/models/test_pdl.py`` holds it to those."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
