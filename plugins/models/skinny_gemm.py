"""A Triton GEMM for skinny activations (a few rows: small-batch decode).

``y = x @ w.T`` with ``x`` of at most ``BLOCK_M`` (16) rows: each program owns
``BLOCK_N`` output columns and streams its ``[BLOCK_N, K]`` slice of the weight
through ``K`` in ``BLOCK_K`` tiles (rows of ``x`` padded to 16 for ``tl.dot``).
Decode at small batch is a pure weight stream, and for the narrower projections
(attention in and out) cuBLAS's choice reaches ~75% of the copy bandwidth on an
H200 while wider tiles streamed this way do better. ``SkinnyDispatch`` measures
both on the actual shapes at start-up and keeps the faster per shape, so nothing
gets slower on a GPU where cuBLAS wins. Decisions are remembered per GPU model,
shape, dtype and software versions in ``$TOKENLOOM_CACHE/skinny-gemm.json`` (and
for the process), so the same setup always runs the same kernels and gives the
same tokens.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from tokenloom.plugins.models import tuning_cache
from tokenloom.plugins.models.cuda_timing import fastest_config, time_graph
from tokenloom.plugins.models.pdl import (
    early_release,
    launch_options,
    pdl_on,
    release,
    release_early,
    wait,
)

log = logging.getLogger("tokenloom.models")

MAX_ROWS = 16
# (BLOCK_N, BLOCK_K, num_warps, num_stages): candidates measured per shape.
CONFIGS = [(16, 512, 4, 4), (32, 256, 4, 4), (32, 512, 4, 3), (64, 256, 4, 3), (16, 1024, 4, 3)]


@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr,  # N % BLOCK_N == 0 and K % BLOCK_K == 0: no masks
    DOT_PRECISION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    mask_m = offs_m[:, None] < M
    # the first tile of the weight before the wait (PDL: while the kernel before runs)
    if EVEN:
        w = tl.load(w_rows + offs_k[None, :])
    else:
        mask_w = (offs_n[:, None] < N) & (offs_k[None, :] < K)
        w = tl.load(w_rows + offs_k[None, :], mask=mask_w, other=0.0)
    wait(USE_PDL)
    release(USE_PDL)
    x = tl.load(x_rows + offs_k[None, :], mask=mask_m & (offs_k[None, :] < K), other=0.0)
    acc = tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        ks = k0 + offs_k[None, :]
        if EVEN:
            w = tl.load(w_rows + ks)
            x = tl.load(x_rows + ks, mask=mask_m, other=0.0)
        else:
            w = tl.load(w_rows + ks, mask=(offs_n[:, None] < N) & (ks < K), other=0.0)
            x = tl.load(x_rows + ks, mask=mask_m & (ks < K), other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    y = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask_m & (offs_n[None, :] < N))


def skinny_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    config: tuple[int, int, int, int],
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ w.T (+ bias)`` for ``x`` [M <= 16, K] and ``w`` [N, K], last dims
    contiguous."""
    m, k = x.shape
    n = w.shape[0]
    block_n, block_k, warps, stages = config
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _skinny_gemm_kernel[(triton.cdiv(n, block_n),)](
        x,
        w,
        bias if bias is not None else w,
        y,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        y.stride(0),
        BLOCK_M=MAX_ROWS,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN=n % block_n == 0 and k % block_k == 0,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        HAS_BIAS=bias is not None,
        num_warps=warps,
        num_stages=stages,
        **launch_options(x.device),
    )
    return y


# The one-row GEMV: (BLOCK_N, BLOCK_K, num_warps), measured per shape against the
# faster of cuBLAS and the skinny GEMM at one row.
GEMV_VERSION = 1  # part of its tuning key: bump when the kernel or its configs change
GEMV_CONFIGS = [(8, 512, 4), (16, 512, 4), (8, 1024, 4), (16, 256, 4), (4, 1024, 4)]


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    N,
    K,
    stride_wn,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
    EARLY: tl.constexpr = False,  # release before the wait (pdl.next_reads_weights_first)
):
    """``y = w @ x`` for one row ``x [K]``: each program streams ``[BLOCK_N, K]`` of the
    weight with plain FMAs into ``[BLOCK_N, BLOCK_K]`` fp32 partial sums (reduced once,
    at the end), the next tile loaded before this one's FMAs (a register double
    buffer). No padding of the row to 16 for ``tl.dot``; with PDL the first tile
    streams while the kernel before finishes."""
    if EARLY:
        release_early(USE_PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n[:, None] < N
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    w = tl.load(w_rows + offs_k[None, :], mask=mask_n & (offs_k[None, :] < K), other=0.0)
    wait(USE_PDL)
    if not EARLY:
        release(USE_PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        x = tl.load(x_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
        nxt = ks[None, :] + BLOCK_K
        w_next = tl.load(w_rows + nxt, mask=mask_n & (nxt < K), other=0.0)
        acc += w.to(tl.float32) * x[None, :]
        w = w_next
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=offs_n < N)


def gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    config: tuple[int, int, int],
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ w.T (+ bias)`` for one row ``x [1, K]`` and ``w [N, K]``, last dims
    contiguous."""
    n, k = w.shape
    assert x.shape == (1, k) and x.stride(1) == 1 and w.stride(1) == 1
    block_n, block_k, warps = config
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        w,
        bias if bias is not None else w,
        y,
        n,
        k,
        w.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_N=block_n,
        BLOCK_K=min(block_k, triton.next_power_of_2(k)),
        num_warps=warps,
        EARLY=early_release(),
        **launch_options(x.device),
    )
    return y


def gemv_offered() -> bool:
    """``TOKENLOOM_BF16_GEMV=0`` keeps the one-row GEMV out of the choice."""
    return os.environ.get("TOKENLOOM_BF16_GEMV", "1") != "0"


Choice = tuple[int, int, int, int] | None
GemvChoice = tuple[int, int, int] | None
_DECIDED: dict[str, Any] = {}  # for the process, on top of the file


CACHE_NAME = "skinny-gemm.json"


def _decided(key: str, measure: Callable[[], Any]) -> Any:
    """The choice stored under ``key`` (this process's, else the cache file's), else
    ``measure()``'s, stored; configs come back as tuples, cuBLAS as None."""
    if key not in _DECIDED:
        stored = tuning_cache.load(CACHE_NAME)
        if key in stored:
            _DECIDED[key] = tuple(stored[key]) if stored[key] else None
        else:
            _DECIDED[key] = measure()
            tuning_cache.store(CACHE_NAME, key, _DECIDED[key])
    return _DECIDED[key]


def _tunable(w: torch.Tensor) -> bool:
    """A 16-bit weight on a GPU, rows contiguous (fp32 stays on cuBLAS: exact agreement
    with reference runs)."""
    return (
        w.device.type == "cuda"
        and w.dim() == 2
        and w.stride(1) == 1
        and w.dtype in (torch.bfloat16, torch.float16)
    )


class SkinnyDispatch:
    """Per weight shape, the faster of cuBLAS and the skinny kernel at 1 and 8 rows
    (measured once per setup); ``choose`` returns the config to use, or None for
    cuBLAS. The skinny kernel must win by 5% to be taken."""

    def __init__(self) -> None:
        self.choices: dict[str, Choice] = {}
        self.gemv_choices: dict[str, GemvChoice] = {}

    def choose(self, w: torch.Tensor) -> Choice:
        if not _tunable(w):
            return None
        key = (
            f"{torch.cuda.get_device_name(w.device)}|torch {torch.__version__}|"
            f"triton {triton.__version__}|{w.shape[0]}x{w.shape[1]}|{w.dtype}"
        )
        self.choices[key] = _decided(key, lambda: self._measure(w))
        return self.choices[key]

    def choose_gemv(self, w: torch.Tensor, skinny: Choice) -> GemvChoice:
        """The one-row GEMV's config for ``w`` where it beats, at one row, what the
        layer runs otherwise (cuBLAS, or ``skinny``) by 3%; else None."""
        if not _tunable(w) or not gemv_offered():
            return None
        key = (
            f"gemv v{GEMV_VERSION}|{torch.cuda.get_device_name(w.device)}|torch {torch.__version__}|"
            f"triton {triton.__version__}|{w.shape[0]}x{w.shape[1]}|{w.dtype}|{skinny}"
            f"|pdl {pdl_on(w.device)}"
        )
        self.gemv_choices[key] = _decided(key, lambda: self._measure_gemv(w, skinny))
        return self.gemv_choices[key]

    def tune(self, model: torch.nn.Module) -> str:
        """Per linear shape of ``model``: the skinny Triton GEMM for inputs of <= 16 rows
        where it measured faster than cuBLAS (small-batch decode), the one-row GEMV for
        single rows where it measured faster than either (the LM head too), and the GEMV
        with the norm (and SiLU) folded in where the model allows it (``Linear.fusable``)
        and it measured faster than the kernels apart. Returns a line for the log."""
        from tokenloom.plugins.models.layers import Embedding, Linear

        fused = 0
        for module in model.modules():
            if isinstance(module, Linear) and module.kernel is None:
                module.skinny = self.choose(module.weight)
                module.gemv = self.choose_gemv(module.weight, module.skinny)
                if module.fusable is not None:
                    silu = module.fusable == "norm+silu"
                    module.fused = self.choose_fused(module.weight, module.gemv, silu, module.bias)
                    fused += module.fused is not None
        lm_head = getattr(model, "lm_head", None)
        if (
            isinstance(lm_head, Embedding)
            and lm_head.logits_kernel is None
            and os.environ.get("TOKENLOOM_LM_HEAD_GEMV", "1") != "0"  # for A/B runs
        ):
            lm_head.gemv = self.choose_gemv(lm_head.weight, None)  # else F.linear
        chosen = sum(c is not None for c in self.choices.values())
        gemvs = sum(c is not None for c in self.gemv_choices.values())
        return (
            f"skinny GEMM chosen for {chosen} of {len(self.choices)} linear shapes, the one-row "
            f"GEMV for {gemvs}, the GEMV with the norm folded in for {fused} layers"
        )

    def choose_fused(
        self,
        w: torch.Tensor,
        gemv_config: GemvChoice,
        silu: bool,
        bias: torch.Tensor | None = None,
    ) -> GemvChoice:
        """The config of the GEMV with the norm (and SiLU) folded in
        (``fused_gemv.norm_gemv``) where it beats, at one row, the add+norm kernel and
        the plain GEMV ``gemv_config`` (then SiLU) by 3%; else None."""
        if gemv_config is None or not _tunable(w):
            return None
        from tokenloom.plugins.models.fused_gemv import FUSED_VERSION, fused_offered

        if not fused_offered():
            return None
        key = (
            f"fused v{FUSED_VERSION}|{torch.cuda.get_device_name(w.device)}|torch "
            f"{torch.__version__}|triton {triton.__version__}|{w.shape[0]}x{w.shape[1]}|"
            f"{w.dtype}|{gemv_config}|silu {silu}|bias {bias is not None}|pdl {pdl_on(w.device)}"
        )
        return _decided(key, lambda: self._measure_fused(w, gemv_config, silu, bias))

    @torch.inference_mode()
    def _measure_fused(
        self, w: torch.Tensor, gemv_config: GemvChoice, silu: bool, bias: torch.Tensor | None
    ) -> GemvChoice:
        from tokenloom.plugins.models.fused_gemv import measure_fused

        assert gemv_config is not None
        best, unfused, fused = measure_fused(w, gemv_config, silu, time_graph, bias)
        log.info(
            "linear %s at one row, norm%s folded in: unfused %.1f us, %s",
            tuple(w.shape),
            " and SiLU" if silu else "",
            unfused,
            f"fused {best} {fused:.1f} us" if best else "kept unfused",
        )
        return best

    @torch.inference_mode()
    def _measure_gemv(self, w: torch.Tensor, skinny: Choice) -> GemvChoice:
        x = torch.randn(1, w.shape[1], dtype=w.dtype, device=w.device)
        # in the weight's dtype: no float32 copy of a large weight (an LM head: 2 GB)
        expected = torch.nn.functional.linear(x, w).float()
        if skinny is None:
            current = time_graph(lambda: torch.nn.functional.linear(x, w))
        else:
            current = time_graph(lambda: skinny_gemm(x, w, skinny))
        best, best_time = fastest_config(
            GEMV_CONFIGS, lambda c: gemv(x, w, c), expected, current, time_graph
        )
        log.info(
            "linear %s at one row: %s %.1f us, %s",
            tuple(w.shape),
            "skinny" if skinny else "cuBLAS",
            current,
            f"GEMV {best} {best_time:.1f} us" if best else "kept",
        )
        return best

    @torch.inference_mode()
    def _measure(self, w: torch.Tensor) -> Choice:
        best: Choice = None
        rows = (1, 8)
        xs = [torch.randn(m, w.shape[1], dtype=w.dtype, device=w.device) for m in rows]
        cublas = sum(time_graph(lambda x=x: torch.nn.functional.linear(x, w)) for x in xs)
        best_time = cublas
        for config in CONFIGS:
            try:
                t = sum(time_graph(lambda x=x, c=config: skinny_gemm(x, w, c)) for x in xs)
            except Exception as err:  # e.g. a tile needing more shared memory than the GPU has
                log.debug("skinny GEMM config %s failed on %s: %s", config, tuple(w.shape), err)
                continue
            if t < (0.95 if best is None else 1.0) * best_time:
                best, best_time = config, t
        log.info(
            "linear %s: cuBLAS %.1f us, %s %.1f us (rows 1 + 8)",
            tuple(w.shape),
            cublas,
            "skinny " + str(best) if best else "kept cuBLAS",
            best_time,
        )
        return best
