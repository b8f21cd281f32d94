"""The K-major int4 tile shared by the dot kernel (``weight_gemm``) and the whole-weight
dequantization (``dequant``): a ``[BLOCK_N, BLOCK_K // 8]`` tile of packed words (the
``[K / 8, N]`` layout, nibble ``j`` of word ``i`` = row ``8 i + j``) becomes
``[BLOCK_N, BLOCK_K]`` 16-bit weights ``(q - z) s`` with each thread holding 8
consecutive K values, so the tile leaves in 16-byte stores. The words are read through
``qweight``'s strides: contiguous ``[K / 8, N]``, or stored row-major per output channel
(``int4_row_major``: the transposed view of a contiguous ``[N, K / 8]``, as int8 is
stored ``[N, K]``).

On sm_90 (bf16) or any GPU (f16) the dequantization is PTX, two values per instruction
(``_dequant8_asm``); elsewhere, and in the interpreter, nibbles are OR-ed into the
mantissa of 2^23 (``_nib``). Both are exact for what every loader here produces (integer
zero points 0-15, scales in the model dtype): the PTX rounds ``m + z`` and ``s`` to the
activations' dtype, and the product rounds once, as the reference's fp32 ``(q - z) * s``
rounded to 16 bits does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _dequant8_asm(magic: str, kind: str) -> str:
    """PTX: one int32 of 8 nibbles ($8), the pair ``(m + z, m + z)`` ($9) and the pair
    ``(s, s)`` ($10) in 16-bit floats -> the 8 dequantized 16-bit values ``(q - z) s``
    ($0..$7, nibble order). A masked nibble pair OR-ed under the exponent of ``m``
    (128 for bf16, 1,024 for f16) reads as ``m + q`` exactly, two at a time; the
    subtraction is exact and the product rounds once, as the reference's fp32
    ``(q - z) * s`` rounded to 16 bits does."""
    lines = ["{", ".reg .b32 t0, t1, t2, t3;", "shr.u32 t1, $8, 4;", "shr.u32 t2, $8, 8;"]
    lines.append("shr.u32 t3, $8, 12;")
    lines.append(f"lop3.b32 t0, $8, 0x000F000F, {magic}, 0xEA;")
    for t in ("t1", "t2", "t3"):
        lines.append(f"lop3.b32 {t}, {t}, 0x000F000F, {magic}, 0xEA;")
    for t in ("t0", "t1", "t2", "t3"):
        lines.append(f"sub.rn.{kind}x2 {t}, {t}, $9;")
        lines.append(f"mul.rn.{kind}x2 {t}, {t}, $10;")
    for j in range(4):  # t_j holds nibbles j (low half) and j + 4 (high half)
        lines.append(f"mov.b32 {{${j}, ${j + 4}}}, t{j};")
    lines.append("}")
    return "\n".join(lines)


_DEQUANT8_BF16 = tl.constexpr(_dequant8_asm("0x43004300", "bf16"))
_DEQUANT8_F16 = tl.constexpr(_dequant8_asm("0x64006400", "f16"))
_DEQUANT8_CONSTRAINTS = tl.constexpr("=h,=h,=h,=h,=h,=h,=h,=h,r,r,r")


@triton.jit
def _join8(v0, v1, v2, v3, v4, v5, v6, v7):
    """``[..., 8]`` of eight same-shaped tensors, in argument order, each thread holding
    the 8 values of its elements (joins add their dimension inside the thread)."""
    lo = tl.join(tl.join(v0, v4), tl.join(v2, v6))
    hi = tl.join(tl.join(v1, v5), tl.join(v3, v7))
    return tl.reshape(tl.join(lo, hi), v0.shape + (8,))


@triton.jit
def _nib(words, j: tl.constexpr):
    """Nibble ``j`` of each word as the float ``2^23 + q`` (OR-ed into its mantissa)."""
    return (((words >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)


@triton.jit
def _pair16(v):
    """A 16-bit float as the int32 holding it twice."""
    b = v.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return b | (b << 16)


@triton.jit
def _dequant_kmajor(words, s, z, x, ASM: tl.constexpr):
    """``[BLOCK_N, BLOCK_K]`` dequantized weights ``(q - z) s`` of a ``[BLOCK_N,
    BLOCK_K // 8]`` tile of packed words, in ``x``'s dtype; ``s`` and ``z`` (fp32) are
    ``[BLOCK_N, 1]``."""
    dt: tl.constexpr = x.dtype
    BN: tl.constexpr = words.shape[0]
    BK: tl.constexpr = words.shape[1] * 8
    if ASM:
        words_z = tl.broadcast_to(
            _pair16((z + (128.0 if dt == tl.bfloat16 else 1024.0)).to(dt)), words.shape
        )
        words_s = tl.broadcast_to(_pair16(s.to(dt)), words.shape)
        v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
            asm=_DEQUANT8_BF16 if dt == tl.bfloat16 else _DEQUANT8_F16,
            constraints=_DEQUANT8_CONSTRAINTS,
            args=[words, words_z, words_s],
            dtype=(x.dtype,) * 8,
            is_pure=True,
            pack=1,
        )
        return tl.reshape(_join8(v0, v1, v2, v3, v4, v5, v6, v7), (BN, BK))
    q = _join8(
        _nib(words, 0),
        _nib(words, 1),
        _nib(words, 2),
        _nib(words, 3),
        _nib(words, 4),
        _nib(words, 5),
        _nib(words, 6),
        _nib(words, 7),
    )
    q = tl.reshape(q, (BN, BK))
    return ((q - (z + 8388608.0)) * s).to(dt)


@triton.jit
def word_rows(k0, BLOCK_K: tl.constexpr):
    """The word rows ``k0 / 8 + i`` of the K tile at ``k0``, a multiple of ``BLOCK_K``
    (so told to Triton: with the word count ``KQ`` an argument, not ``K // 8``, words
    stored row-major load 16 bytes at a time, not 8)."""
    return tl.multiple_of(k0 // 8, BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)


@triton.jit
def word_offsets(kw, offs_n, stride_qk, stride_qn):
    """The offsets of words ``(kw, offs_n)`` (broadcast) of ``qweight [K / 8, N]``.
    Contiguous, ``stride_qn`` is 1 (Triton specializes it: the code is that of the
    unstrided ``kw * N + offs_n``); row-major, ``stride_qk`` is. ``offs_n * stride_qn``
    stays int32: it is below the tensor's word count for every column in range (2^31
    words would be 8 GiB), and masked columns are not read."""
    return kw.to(tl.int64) * stride_qk + offs_n * stride_qn


@triton.jit
def kmajor_tile(
    qw_ptr,
    s_ptr,
    z_ptr,
    k0,
    offs_n,
    mask_n,
    N,
    KQ,  # words per output channel, K / 8
    stride_qk,
    stride_qn,
    x,
    GROUP: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    ASM: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The dequantized ``[BLOCK_N, BLOCK_K]`` tile of columns ``offs_n`` from row ``k0``
    (a multiple of ``BLOCK_K``, in one group), in ``x``'s dtype (only its dtype is read);
    the words at ``qw_ptr + i stride_qk + n stride_qn`` (``word_offsets``)."""
    kw = word_rows(k0, BLOCK_K)
    mask_kw = mask_n[:, None] & (kw < KQ)[None, :]
    words = tl.load(
        qw_ptr + word_offsets(kw[None, :], offs_n[:, None], stride_qk, stride_qn),
        mask=mask_kw,
        other=0,
    )
    g = (k0 // GROUP) * N + offs_n
    s = tl.load(s_ptr + g, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    if HAS_ZEROS:
        z = tl.load(z_ptr + g, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    else:
        z = tl.zeros([offs_n.shape[0], 1], tl.float32)
    return _dequant_kmajor(words, s, z, x, ASM)


def int4_row_major(qweight: torch.Tensor) -> bool:
    """Whether an int4 ``qweight`` (int32, the logical ``[K / 8, N]``) is stored
    row-major per output channel: each channel's ``K / 8`` words contiguous, the
    transposed view of a contiguous ``[N, K / 8]`` (``packed.t().contiguous().t()``),
    i.e. ``qweight.t().is_contiguous()``.

    Where ``N == 1`` or ``K / 8 == 1`` that storage and the contiguous ``[K / 8, N]``
    are the same memory (one run of words, word ``i`` of channel ``n`` at ``i + n``;
    torch ignores the stride of a size-1 dimension), so both count as row-major: True.
    Every kernel reads them correctly either way; True keeps one rule (the memory is
    ``[N, K / 8]``), and only costs the ``[K / 8, N]`` GEMVs on layers that do not occur
    (one output channel, or K = 8)."""
    return qweight.dtype == torch.int32 and qweight.dim() == 2 and qweight.t().is_contiguous()


def dequant_asm_ok(x: torch.Tensor) -> bool:
    """The PTX dequantization: 16-bit activations on a CUDA GPU (``sub``/``mul`` on
    bf16 pairs need sm_90; the interpreter runs no PTX)."""
    if x.device.type != "cuda" or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    major, _ = torch.cuda.get_device_capability(x.device)
    return major >= 9 or x.dtype == torch.float16
