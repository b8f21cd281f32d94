"""The one-row int4 GEMV over weights stored row-major (each output channel's packed words
contiguous, ``[N, K / 8]``), in packed f16x2 arithmetic, with no K split.

Why (session 17). At one row the int4 GEMVs over ``[K / 8, N]`` (``int4_gemv_h2``,
``weight_gemv``) ran at 33-63% of the copy bandwidth on a Llama-3-8B layer (one H200,
``gemv_bench.py --bits 4 --rows 1 --cold``: 52.5 us a layer against 27 at the roofline):
they spend ~3.3 instructions a weight, and the narrow layers split K with a second pass
for the partial sums. int8 gained from the same change of layout (``int8_gemv_nk``): a
program owns ``BLOCK_N`` whole rows, streams them with the next tile in flight, and
reduces once, at the end.

One element of the tile is four consecutive words of a row (32 weights of one group, a
16-byte load). Per element:

- the weights, as in ``int4_gemv_h2``: per word one shift, one ``lop3`` per nibble pair
  (OR-ed under 1,024 in f16), one ``sub`` or ``fma.f16x2`` per pair for ``q - 8`` exactly,
  then one ``fma.rn.f16x2`` per pair: 16 products per f16 half, flushed to fp32 once
  (``_CHAIN_ASM``, ~1.8 instructions a weight);
- x, once per program and shared by its rows (``_X_ASM``): the 32 values scaled by a power
  of two so that their largest lies in [128, 256) (a chain then stays below 2^15, whatever
  the activations' range: a range guard per 32 values, no pre-pass), as f16 pairs
  ``(x_j, x_{j+4})``, with their scaled sum;
- the group's epilogue in fp32, ``s (P up - (z - 8) sum x)``: exact for fractional zero
  points (GGUF Q4_1).

With ``DP4A`` (session 21, ``int4_dp4a_asm``; the tuner's choice on every Llama-3-8B layer)
the products run on the integer unit instead: x per 32 values in 16-bit fixed point, four
``dp4a`` a word, exact sums; 2.30 instructions a weight against 3.06 (whole kernel, 16 x
4096 / 4, offline), 52.4 -> 44.9 us a layer on the H200. ``ONE_TILE`` (``K <= BLOCK_K``)
holds no next tile in registers. Session 22: ``KW`` a constant (the rows' offsets become
the loads' immediates), ``EVEN`` (no masks where the tiles divide the layer) and x in
16-byte loads: 1.86 instructions a weight, 96 registers; 44.8 -> 38.3 us a layer (gate/up
at 86% of the copy bandwidth).

In the interpreter (``ASM`` False) the same structure runs in fp32 arithmetic, so the
indexing, masks and epilogue are tested on the CPU; the PTX is tested on the GPU.

Layout: ``qweight`` is the logical ``[K / 8, N]`` (``weight_gemm``'s) as the transposed
view of ``[N, K / 8]`` storage; ``scales``/``zeros`` ``[G, N]`` as everywhere; groups of
a multiple of 32; one row of bf16 activations on sm_90 (its PTX scales bf16x2 pairs).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tokenloom.plugins.models.pdl import (
    early_release,
    launch_options,
    release,
    release_early,
    wait,
)
from tokenloom.plugins.quant.kernels.gemm_config import GemmConfig
from tokenloom.plugins.quant.kernels.h2_common import _ptx, ptx_bf16_ok
from tokenloom.plugins.quant.kernels.int4_dp4a_asm import _dp4a_chain, _x_bytes
from tokenloom.plugins.quant.kernels.int4_h2_asm import _chain, _x_pairs
from tokenloom.plugins.quant.kernels.int4_qkv_rope import rope_epilogue_on, rope_fits
from tokenloom.plugins.quant.kernels.int4_tiles import int4_row_major
from tokenloom.plugins.quant.kernels.one_row_epilogue import (
    epilogue_args,
    outputs_and_programs,
    program_rows,
    store_outputs,
)
from tokenloom.protocols.components.quant import QkvRope


@triton.jit
def _emu_word(w, x_ptr, k, mask):
    """Interpreter: one word's 8 products ``(q - 8) x`` at K offset ``k`` (fp32)."""
    part = tl.zeros(w.shape, tl.float32)
    for j in tl.static_range(8):
        xj = tl.load(x_ptr + k + j, mask=mask, other=0.0).to(tl.float32)
        part += (((w >> (4 * j)) & 0xF) - 8).to(tl.float32) * xj[None, :]
    return part


@triton.jit
def _emu_xsum(x_ptr, k, mask):
    xs = tl.zeros(k.shape, tl.float32)
    for j in tl.static_range(32):
        xs += tl.load(x_ptr + k + j, mask=mask, other=0.0).to(tl.float32)
    return xs


@triton.jit
def _group_params(s_ptr, z_ptr, kw, offs_n, mask_n, N, KW, GROUP: tl.constexpr,
                  EVEN: tl.constexpr, ZB: tl.constexpr):  # fmt: skip
    """The scales and ``z - ZB`` of the elements starting at words ``kw`` (``[P]``) of the
    rows ``offs_n``, as ``[BLOCK_N, P]`` fp32 (``EVEN``: no masks)."""
    sz = ((kw * 8) // GROUP)[None, :] * N + offs_n[:, None]
    if EVEN:
        s = tl.load(s_ptr + sz).to(tl.float32)
        z = tl.load(z_ptr + sz).to(tl.float32)
    else:
        mask_e = mask_n[:, None] & (kw < KW)[None, :]
        s = tl.load(s_ptr + sz, mask=mask_e, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + sz, mask=mask_e, other=ZB).to(tl.float32)
    if ZB != 0:
        z = z - ZB
    return s, z


@triton.jit
def _split4(w, BLOCK_N: tl.constexpr, P: tl.constexpr):
    """``[BLOCK_N, 4 P]`` words -> four ``[BLOCK_N, P]``: words ``4p``, ``4p+1``, ``4p+2``,
    ``4p+3`` of each element (the split keeps a thread's four words in its registers)."""
    a, b = tl.split(tl.reshape(w, [BLOCK_N, P, 2, 2]))
    w0, w2 = tl.split(a)
    w1, w3 = tl.split(b)
    return w0, w1, w2, w3


@triton.jit
def _int4_gemv_nk_kernel(
    x_ptr,  # [1, K]
    qw_ptr,  # int32 words [N, K / 8]: eight consecutive K weights of one channel each
    s_ptr,  # [G, N]
    z_ptr,  # [G, N]
    b_ptr,
    y_ptr,  # [1, N]
    N,
    KW: tl.constexpr,  # K / 8, a multiple of 4 (a constant: the rows' offsets fold into the loads)
    GROUP: tl.constexpr,  # a multiple of 32
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_KW: tl.constexpr,  # words of a tile row, a multiple of 4
    ASM: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    DP4A: tl.constexpr = False,  # the products on the integer unit (int4_dp4a_asm)
    ONE_TILE: tl.constexpr = False,  # KW <= BLOCK_KW: no next tile to hold in registers
    EVEN: tl.constexpr = False,  # N % BLOCK_N == KW % BLOCK_KW == 0: no masks
    SILU: tl.constexpr = False,  # merged gate/up [2 NH, K] -> silu(gate) * up [NH]
    NH: tl.constexpr = 0,  # SILU: N / 2, a constant (the up rows' offsets immediates too)
    ROPE: tl.constexpr = False,  # merged q/k/v: rotate q and k, store k and v (int4_nk_fused)
    HEAD_DIM: tl.constexpr = 0,  # ROPE: D
    NUM_Q: tl.constexpr = 0,  # ROPE: q heads (rotated), then NUM_KV k heads (rotated,
    NUM_KV: tl.constexpr = 0,  # stored), then NUM_KV v heads (stored)
    cos_ptr=None,  # ROPE: [D / 2] at the token's position
    sin_ptr=None,
    k_cache_ptr=None,  # ROPE: [slots, NUM_KV, D] contiguous, in y's dtype
    v_cache_ptr=None,
    slot_ptr=None,  # ROPE: the token's slot (int64; < 0: store nothing)
    EARLY: tl.constexpr = False,  # release before the wait (pdl.next_reads_weights_first)
):
    if EARLY:
        release_early(USE_PDL)
    P: tl.constexpr = BLOCK_KW // 4
    offs_w = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_KW), 4), 4)
    offs_p = tl.arange(0, P) * 4  # each element's first word
    base, offs_n, mask_n, row_off = program_rows(tl.program_id(0), N, KW, BLOCK_N, SILU, NH,
                                                 ROPE, HEAD_DIM)  # fmt: skip
    # one 64-bit base a program, the rows at 32-bit offsets from it (constants when KW is:
    # the loads then take them as immediates)
    w_rows = qw_ptr + base.to(tl.int64) * KW + row_off[:, None]
    if EVEN:
        w = tl.load(w_rows + offs_w[None, :])
    else:
        w = tl.load(
            w_rows + offs_w[None, :], mask=mask_n[:, None] & (offs_w < KW)[None, :], other=0
        )
    wait(USE_PDL)  # the first tile is in flight; x comes from the kernel before
    if not EARLY:
        release(USE_PDL)
    x32 = x_ptr.to(tl.pointer_type(tl.int32))
    acc = tl.zeros([BLOCK_N, P], tl.float32)
    for k0 in range(0, KW, BLOCK_KW):
        w_next = w
        if not ONE_TILE:
            nxt = k0 + BLOCK_KW + offs_w
            nxt_mask = mask_n[:, None] & (nxt < KW)[None, :]
            w_next = tl.load(w_rows + nxt[None, :], mask=nxt_mask, other=0)
        kw = k0 + offs_p
        mask_p = (kw < KW) | EVEN
        w0, w1, w2, w3 = _split4(w, BLOCK_N, P)
        if ASM and DP4A:  # sum (q - z) v exactly, x in 16-bit fixed point
            s, z = _group_params(s_ptr, z_ptr, kw, offs_n, mask_n, N, KW, GROUP, EVEN, 0.0)
            xo = _x_bytes(x32, kw, mask_p)
            chain = _dp4a_chain(w0, w1, w2, w3, xo)
            up = xo[16][None, :]
            acc += s * (chain * up - z * (xo[17] * xo[16])[None, :])
        else:
            s, z8 = _group_params(s_ptr, z_ptr, kw, offs_n, mask_n, N, KW, GROUP, EVEN, 8.0)
            if ASM:
                xo = _x_pairs(x32, kw, mask_p)
                chain = _chain(w0, w1, w2, w3, xo)
                up = xo[16][None, :]
                acc += s * (chain * up - z8 * (xo[17] * xo[16])[None, :])
            else:
                k = kw * 8
                chain = _emu_word(w0, x_ptr, k, mask_p) + _emu_word(w1, x_ptr, k + 8, mask_p)
                chain += _emu_word(w2, x_ptr, k + 16, mask_p) + _emu_word(w3, x_ptr, k + 24, mask_p)
                acc += s * (chain - z8 * _emu_xsum(x_ptr, k, mask_p)[None, :])
        w = w_next
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    store_outputs(y, y_ptr, tl.program_id(0), base, offs_n, mask_n, BLOCK_N, SILU, NH, ROPE,
                  HEAD_DIM, NUM_Q, NUM_KV, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr,
                  slot_ptr)  # fmt: skip


def int4_nk_fits(x: torch.Tensor, qweight: torch.Tensor, group: int, has_zeros: bool) -> bool:
    """One row of x over row-major int4 words (whole elements of four words), zero points,
    groups of a multiple of 32; on a GPU bf16 on sm_90+, 4-byte aligned; in the interpreter
    any float dtype."""
    kw = qweight.shape[0]
    if x.shape[0] != 1 or not has_zeros or group <= 0 or group % 32 or kw % 4:
        return False
    if not int4_row_major(qweight) or x.stride(1) != 1:
        return False
    if _ptx(x):
        return ptx_bf16_ok(x)
    return x.dtype in (torch.float16, torch.float32, torch.bfloat16)


def int4_nk_fused(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group: int,
    bias: torch.Tensor | None,
    cfg: GemmConfig,
    silu: bool = False,
    rope: QkvRope | None = None,
) -> torch.Tensor | None:
    """One row with an epilogue of the layer's own, where ``cfg`` (the layer's tuned
    one-row tiling) runs this kernel and fits the call; None elsewhere (the caller then
    runs the plain GEMV and the elementwise kernel after it). Switches, read at each
    call (so fixed in a CUDA graph once captured):

    - ``silu``: ``silu(gate) * up`` of a merged gate/up layer; ``TOKENLOOM_INT4_FUSED_SILU=0``
      turns it off.
    - ``rope``: a merged q/k/v layer with q and k rotated and k and v stored in the cache
      (``int4_qkv_rope``); on by default since session 25, ``TOKENLOOM_INT4_FUSED_ROPE=0``
      turns it off (docs/quantization.md)."""
    if silu:
        on = os.environ.get("TOKENLOOM_INT4_FUSED_SILU", "1") != "0" and qweight.shape[1] % 2 == 0
    else:
        on = rope is not None and rope_epilogue_on()
    if not (on and cfg.nk and not cfg.mma and cfg.fits(4, group)):
        return None
    if not int4_nk_fits(x, qweight, group, zeros is not None):
        return None
    if rope is not None and not rope_fits(x, qweight.shape[1], cfg.block_n, rope):
        return None
    return launch_int4_nk(
        x, qweight, scales, zeros, group, bias, cfg.block_n, cfg.block_k, cfg.num_warps,
        cfg.dp4a, silu=silu, rope=rope,
    )  # fmt: skip


def int4_nk_serves(dtype: torch.dtype, device: torch.device, group: int, k: int) -> bool:
    """Whether ``int4_gemv_nk`` can serve a layer's one-row calls (``int4_nk_fits`` for its
    format): what makes row-major storage worth it, for it costs the GEMVs over
    ``[K / 8, N]`` (f16 models and GPUs before sm_90 keep that storage and them)."""
    if group <= 0 or group % 32 or k % 32:
        return False
    if device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] >= 9
    return dtype in (torch.float16, torch.float32, torch.bfloat16)


def launch_int4_rows(
    kernel: triton.JITFunction,
    x: torch.Tensor,
    qweight: torch.Tensor,  # the logical [K / 8, N]: a view of [N, K / 8] storage
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bias: torch.Tensor | None,
    block_n: int,
    block_kw: int,
    num_warps: int,
    *extra: object,
    **constexprs: object,
) -> torch.Tensor:
    """The launch the one-row int4 GEMVs over ``[N, K / 8]`` share (this one and
    ``int4_gemv_mma``): ``y [1, N]`` in ``x``'s dtype; ``extra`` the kernel's runtime
    arguments after ``KW``, ``constexprs`` its own (``SILU``: ``y [1, N / 2]``)."""
    kw, n = qweight.shape
    outputs, grid = outputs_and_programs(n, block_n, bool(constexprs.get("SILU")))
    y = torch.empty(1, outputs, dtype=x.dtype, device=x.device)
    kernel[(grid,)](
        x,
        qweight.t(),  # [N, K / 8], contiguous
        scales,
        zeros,
        bias if bias is not None else scales,
        y,
        n,
        kw,
        *extra,
        HAS_BIAS=bias is not None,
        BLOCK_N=block_n,
        BLOCK_KW=block_kw,
        ASM=_ptx(x),
        num_warps=num_warps,
        **constexprs,
        **launch_options(x.device),
    )
    return y


def launch_int4_nk(
    x: torch.Tensor,
    qweight: torch.Tensor,  # the logical [K / 8, N]: a view of [N, K / 8] storage
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group: int,
    bias: torch.Tensor | None,
    block_n: int,
    block_k: int,
    num_warps: int,
    dp4a: bool = False,
    silu: bool = False,
    rope: QkvRope | None = None,
) -> torch.Tensor:
    """``x [1, K] @ dequant(qweight)^T (+ bias) -> [1, N]`` in ``x``'s dtype
    (``int4_nk_fits``); ``block_k`` K values a tile row; ``dp4a``: the integer products
    (``int4_dp4a_asm``; the interpreter runs the same fp32 emulation either way);
    ``silu``: the rows are a merged gate/up projection, and the result is
    ``silu(gate) * up`` ``[1, N / 2]``, SiLU-and-mul in the epilogue; ``rope``: the rows
    are a merged q/k/v projection, q and k come out rotated and k and v are stored in the
    cache (``rope_fits``)."""
    assert int4_nk_fits(x, qweight, group, zeros is not None), (tuple(x.shape), group)
    kw, n = qweight.shape
    assert rope is None or rope_fits(x, n, block_n, rope)
    block_kw = max(4, min(block_k // 8, triton.next_power_of_2(kw)))
    return launch_int4_rows(
        _int4_gemv_nk_kernel, x, qweight, scales, zeros, bias, block_n, block_kw, num_warps,
        GROUP=group, DP4A=dp4a, ONE_TILE=kw <= block_kw, EVEN=n % block_n == 0 and kw % block_kw == 0,
        EARLY=early_release(), **epilogue_args(n, block_n, silu, rope),
    )  # fmt: skip
