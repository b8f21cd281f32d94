"""How the quantized GEMVs turn packed weights into fp32 for their FMAs, without
integer-to-float conversion instructions (those run at a quarter of the FMA rate): a
small integer OR-ed into the mantissa of a power of two reads as that power plus the
integer, exactly.

- ``int8_word_floats``: on a CUDA GPU, four int8 weights read as one int32 word, one
  PTX ``prmt`` each (``INT8_ASM``): no sign extension or integer add (``int8_gemv_nk``'s
  exact conversion; ``four_floats`` runs such a PTX string).
- ``nibble_floats``: int4 nibble ``j`` of a word under the exponent of 2^(23 - 4j),
  one logic op and one subtraction (exact for fp32 activations).
- ``weight_rows`` / ``first_tile``: the loads of a tile of int4 words (eight rows each,
  ``weight_gemv``'s ``[K / 8, N]``); ``word_row_groups``: the scales or zeros of each
  word row, where int4 groups are smaller than the tile.
- ``nibble_biased`` / ``biased_word_rows``: for 16-bit activations, the nibbles under
  biased exponents (2^11, 2^7, 2^15) and no subtraction per weight; the biases come
  off once per word row (``BIASED_ASM`` on a GPU).

Offline sm_90 counts (``scripts/sass_loop.py gemv 64 128 4 3``, session 10): int4 5.47
-> 5.02 instructions per weight with ``ASM=1 BIASED=1``. The int8 GEMVs over ``[K, N]``
storage that read ``[K, N]`` rows or words here are gone (kernels v14): int8 is stored
``[N, K]`` and runs ``int8_gemv_nk``.
"""

from __future__ import annotations

import triton
import triton.language as tl

MAGIC = tl.constexpr(0x4B000000)  # the bits of 2.0 ** 23 in fp32
MAGIC_F = tl.constexpr(8388608.0)


# PTX for four int8 weights in one register ($4) -> the floats 2^23 + (q + 128) ($0..$3):
# one xor per word turns two's complement into offset binary, then each byte is
# permuted under the exponent bytes of 2^23 (0x4B000000) by one prmt, without a
# sign extension and an integer add.
INT8_ASM = tl.constexpr(
    "{ .reg .b32 t; xor.b32 t, $4, 0x80808080; "
    "prmt.b32 $0, t, 0x4B000000, 0x7440; prmt.b32 $1, t, 0x4B000000, 0x7441; "
    "prmt.b32 $2, t, 0x4B000000, 0x7442; prmt.b32 $3, t, 0x4B000000, 0x7443; }"
)


@triton.jit
def nibble_floats(words, high, nibble, j: tl.constexpr):
    """Nibble ``j`` of each word as a float. It sits at bit p = 4j (j < 5) or, in
    ``high = words >> 12``, at 4j - 12 (j >= 5): p <= 16 either way. OR-ed under the
    exponent of 2^(23 - p) it reads as the float 2^(23 - p) + q exactly, so a weight
    costs one logic op (and + or), one subtraction and one FMA, without a shift.
    ``nibble`` is 0xF passed at run time: a constant mask was re-materialised by a
    move before every use."""
    if j < 5:
        bits = (words & (nibble << (4 * j))) | ((150 - 4 * j) << 23)
        return bits.to(tl.float32, bitcast=True) - (2.0 ** (23 - 4 * j))
    else:
        bits = (high & (nibble << (4 * j - 12))) | ((162 - 4 * j) << 23)
        return bits.to(tl.float32, bitcast=True) - (2.0 ** (35 - 4 * j))


@triton.jit
def nibble_biased(words, low, high, m8, m12, m16, j: tl.constexpr):
    """Nibble ``j`` as the float ``A_j + q``, with no subtraction: the nibble sits at bit
    p = 12, 16 or 8 (``j % 3`` = 0, 1, 2) of ``low = words << 12`` (nibbles 0-1),
    ``words`` (2-4) or ``high = words >> 12`` (5-7), OR-ed under the exponent of
    ``A_j = 2^(23 - p)`` (2,048, 128, 32,768). The FMA accumulates
    ``sum_j (A_j + q_j) x_j`` and ``biased_word_rows`` takes ``sum_j A_j x_j`` off:
    one logic op and one FMA per weight, not three. For 16-bit activations only (fp32
    activations keep ``nibble_floats``, exact)."""
    if j < 2:
        v = low
    elif j < 5:
        v = words
    else:
        v = high
    if j % 3 == 0:
        bits = (v & m12) | 0x45000000  # 2^11 + q
    elif j % 3 == 1:
        bits = (v & m16) | 0x43000000  # 2^7 + q
    else:
        bits = (v & m8) | 0x47000000  # 2^15 + q
    return bits.to(tl.float32, bitcast=True)


# PTX for nibble_biased on one word ($8) -> its 8 nibbles as floats A_j + q ($0..$7): two
# shifts and eight lop3 (opaque to the compiler, which otherwise rewrites
# (w << 12) & (0xF << 12) into ((w & 0xF) << 12) and splits the and-or in two).
BIASED_ASM = tl.constexpr(
    "{ .reg .b32 lo, hi; shl.b32 lo, $8, 12; shr.s32 hi, $8, 12; "
    "lop3.b32 $0, lo, 0x0000F000, 0x45000000, 0xEA; "
    "lop3.b32 $1, lo, 0x000F0000, 0x43000000, 0xEA; "
    "lop3.b32 $2, $8, 0x00000F00, 0x47000000, 0xEA; "
    "lop3.b32 $3, $8, 0x0000F000, 0x45000000, 0xEA; "
    "lop3.b32 $4, $8, 0x000F0000, 0x43000000, 0xEA; "
    "lop3.b32 $5, hi, 0x00000F00, 0x47000000, 0xEA; "
    "lop3.b32 $6, hi, 0x0000F000, 0x45000000, 0xEA; "
    "lop3.b32 $7, hi, 0x000F0000, 0x43000000, 0xEA; }"
)


@triton.jit
def biased_word_rows(words, x_ptrs, mask, m8, m12, m16, ASM: tl.constexpr):
    """``(sum_j q_j x_j, sum_j x_j)`` per word row of a ``[rows, BLOCK_N]`` tile of
    words, with ``nibble_biased`` (``BIASED_ASM`` on a GPU): one logic op and one FMA
    per weight. Two accumulators each begin with a 2^15-biased nibble (j = 2, j = 5),
    seeded with ``-2^15 x_j`` (exact in the FMA the GPU compiles it to), so no
    partial sum ever holds a 2^15 bias; the 2^11 and 2^7 biases (``xa``) come off at
    the end. A word row's sum keeps ~12 of fp32's 24 bits below its largest
    ``A_j x_j`` (2^11)."""
    if ASM:
        v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
            asm=BIASED_ASM,
            constraints="=r,=r,=r,=r,=r,=r,=r,=r,r",
            args=[words],
            dtype=(tl.float32,) * 8,
            is_pure=True,
            pack=1,
        )
    else:
        low = words << 12
        high = words >> 12
        v0 = nibble_biased(words, low, high, m8, m12, m16, 0)
        v1 = nibble_biased(words, low, high, m8, m12, m16, 1)
        v2 = nibble_biased(words, low, high, m8, m12, m16, 2)
        v3 = nibble_biased(words, low, high, m8, m12, m16, 3)
        v4 = nibble_biased(words, low, high, m8, m12, m16, 4)
        v5 = nibble_biased(words, low, high, m8, m12, m16, 5)
        v6 = nibble_biased(words, low, high, m8, m12, m16, 6)
        v7 = nibble_biased(words, low, high, m8, m12, m16, 7)
    x0 = tl.load(x_ptrs + 0, mask=mask, other=0.0).to(tl.float32)
    x1 = tl.load(x_ptrs + 1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptrs + 2, mask=mask, other=0.0).to(tl.float32)
    x3 = tl.load(x_ptrs + 3, mask=mask, other=0.0).to(tl.float32)
    x4 = tl.load(x_ptrs + 4, mask=mask, other=0.0).to(tl.float32)
    x5 = tl.load(x_ptrs + 5, mask=mask, other=0.0).to(tl.float32)
    x6 = tl.load(x_ptrs + 6, mask=mask, other=0.0).to(tl.float32)
    x7 = tl.load(x_ptrs + 7, mask=mask, other=0.0).to(tl.float32)
    pa = v2 * x2[:, None] - (x2 * 32768.0)[:, None]
    pa += v0 * x0[:, None]
    pa += v1 * x1[:, None]
    pa += v3 * x3[:, None]
    pb = v5 * x5[:, None] - (x5 * 32768.0)[:, None]
    pb += v4 * x4[:, None]
    pb += v6 * x6[:, None]
    pb += v7 * x7[:, None]
    xa = 2048.0 * ((x0 + x3) + x6) + 128.0 * ((x1 + x4) + x7)
    xs = ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))
    return (pa + pb) - xa[:, None], xs


@triton.jit
def four_floats(words, ASM_TEXT: tl.constexpr):
    """Four fp32 results per int32 word from the PTX ``ASM_TEXT`` ($0-$3 out, $4 in)."""
    return tl.inline_asm_elementwise(
        asm=ASM_TEXT,
        constraints="=r,=r,=r,=r,r",
        args=[words],
        dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
        is_pure=True,
        pack=1,
    )


@triton.jit
def int8_word_floats(words, ASM: tl.constexpr = True):
    """The four int8 weights of each int32 word (byte i the i-th; in ``int8_gemv_nk``
    four consecutive K values of one output channel) as floats, exactly: ``INT8_ASM``
    (or, in the interpreter, the same bits by shifts and masks), then the offset
    2^23 + 128 taken off."""
    if ASM:
        w0, w1, w2, w3 = four_floats(words, INT8_ASM)
    else:
        t = words ^ -0x7F7F7F80  # 0x80808080 as an int32
        w0 = ((t & 0xFF) | MAGIC).to(tl.float32, bitcast=True)
        w1 = (((t >> 8) & 0xFF) | MAGIC).to(tl.float32, bitcast=True)
        w2 = (((t >> 16) & 0xFF) | MAGIC).to(tl.float32, bitcast=True)
        w3 = (((t >> 24) & 0xFF) | MAGIC).to(tl.float32, bitcast=True)
    return (
        w0 - (MAGIC_F + 128.0),
        w1 - (MAGIC_F + 128.0),
        w2 - (MAGIC_F + 128.0),
        w3 - (MAGIC_F + 128.0),
    )


@triton.jit
def weight_rows(qw_ptr, rows, limit, offs_n, mask_n, N):
    """``qweight[rows, offs_n]`` (zeros from row ``limit`` on): the int4 words that pack
    eight rows each."""
    return tl.load(
        qw_ptr + rows[:, None].to(tl.int64) * N + offs_n[None, :],
        mask=(rows < limit)[:, None] & mask_n[None, :],
        other=0,
    )


@triton.jit
def word_row_groups(ptr, kw, mask_kw, offs_n, mask_n, N, GROUP: tl.constexpr):
    """``ptr[8 kw // GROUP, offs_n]`` in fp32: the scales (or zeros) ``[G, N]`` of the
    group of each word row ``kw``, for int4 groups smaller than the tile (``GROUP`` a
    multiple of 8: a word's eight rows lie in one group)."""
    g = (kw // (GROUP // 8))[:, None] * N + offs_n[None, :]
    return tl.load(ptr + g, mask=mask_kw[:, None] & mask_n[None, :], other=0.0).to(tl.float32)


@triton.jit
def first_tile(qw_ptr, k_begin, k_end, offs_n, mask_n, N, BLOCK_K: tl.constexpr):
    """The int4 words of the split's first ``BLOCK_K`` rows (the register double
    buffer's first fill)."""
    kw = k_begin // 8 + tl.arange(0, BLOCK_K // 8)
    return weight_rows(qw_ptr, kw, k_end // 8, offs_n, mask_n, N)
