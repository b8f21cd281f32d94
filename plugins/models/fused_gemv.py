"""The one-row GEMV with the decoder's elementwise neighbours folded in: the residual
add and RMSNorm before it, and SiLU-and-mul after it (the gate/up projection).

At batch 1 a decoder layer ran nine kernels: add+norm, q/k/v GEMV, rope, attention,
o GEMV, add+norm, gate/up GEMV, SiLU, down GEMV. The norms and SiLU move no bytes worth
speaking of; what they cost is a kernel boundary each (launch, ramp-up, the wait for
the kernel before), about 2 us on an H200 even with PDL, and Qwen3-0.6B's layers are
nothing but such boundaries. Here they are six.

How the norm folds in without a pass of its own: the GEMV already walks the whole row
``x`` (no split over K), so it accumulates ``sum(x^2)`` beside ``W (x * w_norm)`` and
scales each output by ``rsqrt(mean(x^2) + eps)`` at the end (the scale is one scalar
per row, so it commutes with the dot product). The residual add ``x = hidden +
residual`` is made tile by tile as the row is read, rounded to the model dtype as the
unfused kernel rounds it, and program 0 stores it into a new buffer: the next layer's
residual (other programs still read the old one, so never in place). With ``SILU`` a
program owns the same ``BLOCK_N`` columns of the gate half and of the up half of the
merged weight and stores ``silu(gate) * up``.

Numerics: the unfused path rounds the normed row to the model dtype before the GEMV;
this one does not (it keeps fp32 up to the accumulator), so outputs differ from it in
the last bits, as any change of summation order does.

Where it pays is measured per shape (``measure_fused``, through
``SkinnyDispatch.choose_fused``): the folded norm costs loads of the row, the residual
and the norm weight in every program, which a narrow tile (few weight rows per program)
does not amortize.

``TOKENLOOM_FUSED_NORM_GEMV=0`` keeps the unfused kernels (read at each call, for A/B
runs in one process).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from tokenloom.plugins.models import fused_ops
from tokenloom.plugins.models.layers import Linear, RMSNorm, silu_and_mul
from tokenloom.plugins.models.pdl import launch_options, release, wait
from tokenloom.protocols.components.quant import Fp8Rows, PermutedRows, QkvRope

FUSED_VERSION = 1  # part of its tuning key: bump when the kernel or its configs change
# (BLOCK_N, BLOCK_K, num_warps): wider tiles than the plain GEMV's, to amortize the row
FUSED_CONFIGS = [(8, 512, 4), (16, 512, 4), (16, 256, 4), (32, 256, 4), (32, 512, 8), (64, 256, 8)]


@triton.jit
def _norm_gemv_kernel(
    h_ptr,
    r_ptr,
    nw_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    res_out_ptr,
    N,
    K,
    stride_wn,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """``y = W norm(h + r)`` for one row (``N`` outputs; with ``SILU``, ``N`` is the
    width of each half and ``y = silu(W_gate x) * W_up x``)."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n[:, None] < N
    rows_a = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    rows_b = rows_a + N * stride_wn  # the up half (SILU only)
    first = mask_n & (offs_k[None, :] < K)
    wa = tl.load(rows_a + offs_k[None, :], mask=first, other=0.0)  # weights: before the wait
    if SILU:
        wb = tl.load(rows_b + offs_k[None, :], mask=first, other=0.0)
    wait(USE_PDL)
    release(USE_PDL)
    acc_a = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_b = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    squares = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        in_k = ks < K
        x = tl.load(h_ptr + ks, mask=in_k, other=0.0)
        if HAS_RESIDUAL:
            x = x.to(tl.float32) + tl.load(r_ptr + ks, mask=in_k, other=0.0).to(tl.float32)
            x = x.to(res_out_ptr.dtype.element_ty)  # the stored residual, as unfused
            if pid == 0:
                tl.store(res_out_ptr + ks, x, mask=in_k)
        xf = x.to(tl.float32)
        squares += xf * xf
        xn = xf * tl.load(nw_ptr + ks, mask=in_k, other=0.0).to(tl.float32)
        nxt = ks[None, :] + BLOCK_K
        more = mask_n & (nxt < K)
        wa_next = tl.load(rows_a + nxt, mask=more, other=0.0)
        acc_a += wa.to(tl.float32) * xn[None, :]
        wa = wa_next
        if SILU:
            wb_next = tl.load(rows_b + nxt, mask=more, other=0.0)
            acc_b += wb.to(tl.float32) * xn[None, :]
            wb = wb_next
    rstd = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
    y = tl.sum(acc_a, axis=1) * rstd
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    if SILU:
        # rounded where the unfused GEMV output and SiLU kernel round
        gate = y.to(y_ptr.dtype.element_ty).to(tl.float32)
        up = (tl.sum(acc_b, axis=1) * rstd).to(y_ptr.dtype.element_ty).to(tl.float32)
        act = (gate * tl.sigmoid(gate)).to(y_ptr.dtype.element_ty).to(tl.float32)
        y = act * up
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=offs_n < N)


def norm_gemv(
    hidden: torch.Tensor,  # [1, K]
    residual: torch.Tensor | None,  # [1, K]; None: the row is ``hidden`` itself
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    w: torch.Tensor,  # [N, K] (with silu: [2I, K], gate rows then up rows)
    config: tuple[int, int, int],  # the one-row GEMV's (BLOCK_N, BLOCK_K, num_warps)
    bias: torch.Tensor | None = None,
    silu: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W norm(hidden + residual) (+ bias), hidden + residual)``; with ``silu``,
    ``silu(gate) * up`` of the merged projection instead of its output."""
    n, k = w.shape
    assert hidden.shape == (1, k) and hidden.stride(1) == 1 and w.stride(1) == 1
    assert residual is None or (residual.shape == (1, k) and residual.stride(1) == 1)
    assert not (silu and bias is not None), "SiLU-and-mul takes no bias"
    block_n, block_k, warps = config
    if silu:
        n //= 2
        block_n = max(1, block_n // 2)  # two halves per program: the same rows in flight
    y = torch.empty(1, n, dtype=hidden.dtype, device=hidden.device)
    summed = torch.empty_like(hidden) if residual is not None else hidden
    _norm_gemv_kernel[(triton.cdiv(n, block_n),)](
        hidden,
        residual if residual is not None else hidden,
        norm_weight,
        w,
        bias if bias is not None else w,
        y,
        summed,
        n,
        k,
        w.stride(0),
        eps,
        HAS_RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None,
        SILU=silu,
        BLOCK_N=block_n,
        BLOCK_K=min(block_k, triton.next_power_of_2(k)),
        num_warps=warps,
        **launch_options(hidden.device),
    )
    return y, summed


def norm_and_project(
    norm: RMSNorm,
    linear: Linear,
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    silu: bool = False,
    then: Linear | None = None,
) -> tuple[torch.Tensor | Fp8Rows | PermutedRows, torch.Tensor]:
    """``(linear(norm(hidden + residual)), hidden + residual)``: the residual stream's
    next value and the projection of its norm (with ``silu``, SiLU-and-mul of the
    merged gate/up projection). A None residual: the stream starts at ``hidden``.
    One kernel where the layer's one-row GEMV takes the norm (``Linear.fuses_norm``),
    else the norm, the projection and SiLU in turn. The norm comes quantized per token
    where ``linear`` takes such rows (``Linear.takes_fp8_rows``), and so does SiLU's
    result where ``then`` (the layer it feeds) does: then the first value is ``Fp8Rows``.
    Where ``linear`` keeps its inputs in another order (``Linear.input_order``: act-order
    weights) the norm stores its columns so (and SiLU for ``then`` likewise:
    ``PermutedRows``), in place of a gather before the projection."""
    if linear.fuses_norm(hidden):
        assert linear.fused is not None
        return norm_gemv(
            hidden, residual, norm.weight, norm.eps, linear.weight, linear.fused, linear.bias, silu
        )
    normed: torch.Tensor | Fp8Rows | PermutedRows
    order = linear.input_order
    if order is not None:  # the norm stores its columns in the kernel's input order
        gathered, residual = add_norm(norm, hidden, residual, order)
        normed = PermutedRows(gathered)
    elif hidden.dim() == 2 and linear.takes_fp8_rows(hidden):
        normed, residual = norm.add_and_norm_fp8(hidden, residual)
    else:
        normed, residual = add_norm(norm, hidden, residual)
    return (project_silu(linear, normed, then) if silu else linear(normed)), residual


def add_norm(
    norm: RMSNorm,
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    order: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(hidden + residual), hidden + residual)``; a None residual: the stream starts
    at ``hidden``. With ``order`` the norm's columns come gathered (``RMSNorm.forward``)."""
    if residual is None:
        return norm(hidden, order), hidden
    return norm.add_and_norm(hidden, residual, order)


def project_rope(linear: Linear, x: torch.Tensor, rope: QkvRope) -> torch.Tensor | None:
    """A merged q/k/v projection of one decode token with q and k rotated and k and v
    stored in the cache inside the quantized kernel's matmul, where it offers that
    (``LinearKernel.apply_qkv_rope``); None: not done (the caller projects, then rotates)."""
    if linear.kernel is None or linear.parallel == "row":
        return None
    return linear.kernel.apply_qkv_rope(x, linear.bias, rope)


def project_silu(
    linear: Linear, x: torch.Tensor | Fp8Rows | PermutedRows, then: Linear | None = None
) -> torch.Tensor | Fp8Rows | PermutedRows:
    """``silu_and_mul(linear(x))`` for a merged gate/up projection: inside the quantized
    kernel's matmul where it offers that (``LinearKernel.apply_silu_and_mul``). Where
    ``then`` takes the result's rows quantized per token (``Linear.takes_fp8_rows``),
    SiLU-and-mul quantizes them in its kernel and returns ``Fp8Rows``; where ``then``
    keeps its inputs in another order (``Linear.input_order``), it stores them so and
    returns ``PermutedRows``."""
    halves = len(linear.output_sizes) == 2 and linear.output_sizes[0] == linear.output_sizes[1]
    if (
        isinstance(x, torch.Tensor)
        and linear.kernel is not None
        and linear.parallel != "row"
        and halves
    ):
        y = linear.kernel.apply_silu_and_mul(x, linear.bias)
        if y is not None:
            return y
    gate_up = linear(x)
    if then is not None and then.input_order is not None:
        return PermutedRows(silu_and_mul(gate_up, then.input_order))
    if (
        then is not None
        and gate_up.dim() == 2
        and gate_up.shape[1] // 2 <= fused_ops.FP8_ROW_MAX
        and then.takes_fp8_rows(gate_up[:, : gate_up.shape[1] // 2])
    ):
        return fused_ops.silu_and_mul_fp8(gate_up)
    return silu_and_mul(gate_up)


def measure_fused(
    w: torch.Tensor,
    gemv_config: tuple[int, int, int],
    silu: bool,
    time_graph: Callable[[Callable[[], object]], float],
    bias: torch.Tensor | None = None,
) -> tuple[tuple[int, int, int] | None, float, float]:
    """(best fused config or None, unfused us, best fused us): the add+norm kernel and
    the plain GEMV (then SiLU) against each fused config, at one row, on ``w``'s GPU; a
    config must agree with the unfused result and be 3% faster."""
    from tokenloom.plugins.models.cuda_timing import fastest_config
    from tokenloom.plugins.models.skinny_gemm import gemv

    k = w.shape[1]
    hidden, residual = (torch.randn(1, k, dtype=w.dtype, device=w.device) for _ in range(2))
    norm_w = torch.ones(k, dtype=w.dtype, device=w.device)

    def unfused() -> torch.Tensor:
        x, _ = fused_ops.add_rms_norm(hidden, norm_w, 1e-6, residual)
        y = gemv(x, w, gemv_config, bias)
        return fused_ops.silu_and_mul(y) if silu else y

    expected = unfused().float()
    baseline = time_graph(unfused)
    best, best_time = fastest_config(
        FUSED_CONFIGS,
        lambda c: norm_gemv(hidden, residual, norm_w, 1e-6, w, c, bias, silu)[0],
        expected,
        baseline,
        time_graph,
    )
    return best, baseline, best_time
