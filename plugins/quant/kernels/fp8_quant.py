"""Per-token fp8 quantization of activations in one Triton kernel.

``x [M, K]`` -> ``(e4m3 [M, K], scales [M, 1] float32)`` with ``s = max|x_row| / 448``,
the same arithmetic as ``fp8.quantize_fp8_rows`` (its oracle). In torch that is six
kernels (abs, max, clamp, two divisions, cast) per linear layer, which at batch 1 cost
more than the fp8 GEMM itself; here one program per row reads it twice (the second
time from cache) and writes both outputs. An opt-in variant (``ONE_PASS``) holds rows
of up to 16,384 elements in registers: one load.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tokenloom.plugins.models.pdl import launch_options, release, wait

FP8_MAX = 448.0


@triton.jit
def _per_token_fp8_kernel(
    x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):
    wait(USE_PDL)
    release(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    amax = tl.zeros([BLOCK], tl.float32)
    for k0 in range(0, K, BLOCK):
        ks = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    # IEEE-rounded divisions (Triton's `/` is approximate): bit-equal to the torch oracle
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), 1e-12), 448.0)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        ks = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0)
        tl.store(q_ptr + row * stride_q + ks, q.to(q_ptr.dtype.element_ty), mask=ks < K)


@triton.jit
def _per_token_fp8_row_kernel(
    x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):
    """``_per_token_fp8_kernel`` for rows of at most ``BLOCK`` elements: the row is
    loaded once and kept in registers, so a call is one load round, not two passes of
    up to 7 (K = 14,336 in 2,048-element blocks) one after another. The same
    arithmetic, so the same bits."""
    wait(USE_PDL)
    release(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + ks, mask=ks < K, other=0.0).to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12), 448.0)
    tl.store(s_ptr + row, scale)
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0)
    tl.store(q_ptr + row * stride_q + ks, q.to(q_ptr.dtype.element_ty), mask=ks < K)


ROW_BLOCK_MAX = 16384  # rows up to this length can take the one-pass kernel
# On by default since it was measured (session 11, one H200, `bench latency --model
# llama-3-8b --quant fp8`: 3.98 -> 3.89 ms per step, and 3.94 -> 3.84 in a second machine
# start, both without PDL; predicted ~0.3 ms: 128 calls per
# step, down_proj's K = 14,336 took 14 dependent load rounds); TOKENLOOM_FP8_ONE_PASS=0
# turns it off (read once).
ONE_PASS = os.environ.get("TOKENLOOM_FP8_ONE_PASS", "1") != "0"


def per_token_fp8(
    x: torch.Tensor, one_pass: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (last dim contiguous, on the GPU) -> ``(e4m3 [M, K], [M, 1] fp32)``.
    With ``one_pass`` (default ``ONE_PASS``), rows of up to ``ROW_BLOCK_MAX`` elements
    take the one-pass kernel."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    one_pass = (ONE_PASS if one_pass is None else one_pass) and k <= ROW_BLOCK_MAX
    if one_pass:
        block = triton.next_power_of_2(k)
        warps = max(4, min(16, block // 1024))  # about 32 elements a thread
        _per_token_fp8_row_kernel[(m,)](
            x, q, scales, k, x.stride(0), q.stride(0), BLOCK=block, num_warps=warps,
            **launch_options(x.device),
        )  # fmt: skip
        return q, scales
    block = min(2048, triton.next_power_of_2(k))
    _per_token_fp8_kernel[(m,)](
        x, q, scales, k, x.stride(0), q.stride(0), BLOCK=block, num_warps=4,
        **launch_options(x.device),
    )  # fmt: skip
    return q, scales
