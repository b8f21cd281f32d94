"""Dequantize a whole weight-only quantized matrix into a 16-bit ``[N, K]`` buffer, for
the large batches where cuBLAS on 16-bit weights beats a kernel that dequantizes per
tile (prefill chunks: the weights are read once per step, the tile kernel converts
them once per row block).

``dequantize_into(qweight, scales, zeros, bits, group, dtype)`` returns a view of a
per-device scratch buffer (one buffer, grown to the largest layer and reused: every
layer's ``F.linear`` has consumed it before the next layer writes it, since one
stream runs them in order). ``reserve`` grows it ahead of time, at load, so that it is
never allocated inside a CUDA graph capture and the memory planner's profile sees it.
A decode step's second micro-batch, on its own stream (``MICRO_BATCH_LANE`` 1), has a
buffer of its own, made at its eager warm-up before capture (not in the planner's
profile: the largest layer's 16-bit weight, 235 MB at Llama-3-8B's gate/up).

int4 tiles use the K-major dequantization of ``int4_tiles`` (8 consecutive K values
per thread, 16-byte stores; PTX pairs on sm_90); both widths read the weights through
their strides: ``[K', N]`` storage, or ``[N, K']`` (``qweight`` the transposed view: int8
as ``quantize_int8`` stores it since session 16, int4 where ``int4_row_major``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenloom.plugins.quant.kernels.int4_tiles import dequant_asm_ok, kmajor_tile
from tokenloom.protocols.components.quant import MICRO_BATCH_LANE

_SCRATCH: dict[tuple[torch.device, torch.dtype, int], torch.Tensor] = {}


def _key(device: torch.device | str, dtype: torch.dtype) -> tuple[torch.device, torch.dtype, int]:
    """``cuda`` and ``cuda:N`` of the current device name one buffer (tensors say
    ``cuda:N``); one per micro-batch lane."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device, dtype, MICRO_BATCH_LANE.get()


def reserve(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The scratch buffer for ``(device, dtype)``, at least ``numel`` elements."""
    key = _key(device, dtype)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < numel:
        if key[0].type == "cuda" and torch.cuda.is_current_stream_capturing():
            # a captured graph may hold the old buffer's address: growing it now would
            # leave that graph writing freed memory
            raise RuntimeError("the dequantization buffer must be reserved before capture")
        _SCRATCH.pop(key, None)  # free the smaller one first
        buf = _SCRATCH[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf


def release(dtype: torch.dtype, device: torch.device) -> None:
    """Drop the buffer (the tuner's measurement grew it; ``reserve`` again if chosen)."""
    _SCRATCH.pop(_key(device, dtype), None)


@triton.jit
def _dequant_kernel(
    qw_ptr,
    s_ptr,
    z_ptr,
    out_ptr,
    N,
    K,
    KQ,  # qweight's rows, K / 8 for int4
    stride_qk,  # the weights' strides as [K', N] (N, 1; or 1, K' when stored [N, K'])
    stride_qn,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    ASM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    ks = k0 + tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    # the dtype of the output, for kmajor_tile (it reads only the dtype)
    like = tl.zeros([1, 1], out_ptr.dtype.element_ty)
    if BITS == 4:
        w = kmajor_tile(
            qw_ptr,
            s_ptr,
            z_ptr,
            k0,
            offs_n,
            mask_n,
            N,
            KQ,
            stride_qk,
            stride_qn,
            like,
            GROUP,
            HAS_ZEROS,
            ASM,
            BLOCK_K,
        )
    else:  # int8, one scale per output channel
        q = tl.load(
            qw_ptr
            + ks[None, :].to(tl.int64) * stride_qk
            + offs_n[:, None].to(tl.int64) * stride_qn,
            mask=mask_n[:, None] & (ks < K)[None, :],
            other=0,
        )
        s = tl.load(s_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        w = (q.to(tl.float32) * s).to(out_ptr.dtype.element_ty)
    out = out_ptr + offs_n[:, None].to(tl.int64) * K + ks[None, :]
    tl.store(out, w, mask=mask_n[:, None] & (ks < K)[None, :])


def fits(bits: int, group: int) -> bool:
    """int4 in groups that hold whole 64-wide tiles, or int8 per channel."""
    return (bits == 4 and group > 0 and group % 64 == 0) or (bits == 8 and group == 0)


def dequantize_into(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bits: int,
    group: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The dequantized weight ``[N, K]`` in ``dtype`` (a view of the scratch buffer: valid
    until the next call on this device and dtype)."""
    assert fits(bits, group), (bits, group)
    n = qweight.shape[1]
    k = qweight.shape[0] * (8 if bits == 4 else 1)
    out = reserve(n * k, dtype, qweight.device)[: n * k].view(n, k)
    block_n, block_k = 64, 64
    like = torch.empty(0, dtype=dtype, device=qweight.device)
    _dequant_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        qweight,
        scales,
        zeros if zeros is not None else scales,
        out,
        n,
        k,
        qweight.shape[0],
        qweight.stride(0),
        qweight.stride(1),
        BITS=bits,
        GROUP=group,
        HAS_ZEROS=zeros is not None,
        ASM=bits == 4 and dequant_asm_ok(like),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
    )
    return out
