"""The PTX of the int4 GEMV's integer path (``int4_dp4a_asm``), run instruction by
instruction in a small emulator on the CPU: the interpreter runs the kernel's fp32
emulation instead, so without this only a GPU would see a wrong byte order, sign or scale.

The emulator does what the PTX ISA says for the instructions used: ``prmt`` picks bytes of
``{b, a}``; ``dp4a.atype.btype`` multiplies the four byte pairs, signed or not as typed;
``fma.rn.f32`` rounds once (done in float64, where ``x 2^s + 1.5 2^23`` is exact whenever
it can round to anything but ``1.5 2^23``, then rounded to float32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenloom.plugins.quant.kernels import int4_dp4a_asm as asm

M32 = 0xFFFFFFFF


def _f32(bits: int) -> float:
    return float(np.array([bits & M32], np.uint32).view(np.float32)[0])


def _bits(value: float) -> int:
    return int(np.array([value], np.float32).view(np.uint32)[0])


def _s32(x: int) -> int:
    x &= M32
    return x - (1 << 32) if x >> 31 else x


def _byte(x: int, i: int, signed: bool) -> int:
    b = (x >> (8 * i)) & 0xFF
    return b - 256 if signed and b >= 128 else b


def _prmt(a: int, b: int, sel: int) -> int:
    src, out = (b << 32) | a, 0
    for i in range(4):
        out |= ((src >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i)
    return out


def _fma(a: int, b: int, c: int) -> int:
    return _bits(float(np.float32(np.float64(_f32(a)) * _f32(b) + _f32(c))))


OPS = {
    "and.b32": lambda a, b: a & b,
    "shr.u32": lambda a, b: a >> b,
    "shl.b32": lambda a, b: a << b,
    "max.u16x2": lambda a, b: max(a & 0xFFFF, b & 0xFFFF) | max(a >> 16, b >> 16) << 16,
    "max.u32": max,
    "sub.s32": lambda a, b: _s32(a) - _s32(b),
    "min.s32": lambda a, b: min(_s32(a), _s32(b)),
    "setp.eq.u32": lambda a, b: int(a == b),
    "selp.b32": lambda a, b, p: a if p else b,
    "mov.b32": lambda a: a,
    "fma.rn.f32": _fma,
    "prmt.b32": _prmt,
    "mad.lo.s32": lambda a, b, c: _s32(a) * _s32(b) + _s32(c),
    "cvt.rn.f32.s32": lambda a: _bits(float(_s32(a))),
}


def _run(text: str, operands: dict[int, int]) -> dict[int, int]:
    regs: dict[str, int] = {}

    def value(tok: str) -> int:
        if tok.startswith("$"):
            return operands[int(tok[1:])]
        if tok[0].isdigit():
            return int(tok, 0) & M32
        return regs[tok]

    body = text.strip()
    assert body[0] == "{" and body[-1] == "}"
    for ins in filter(None, (i.strip() for i in body[1:-1].split(";"))):
        if ins.startswith(".reg"):
            continue
        op, rest = ins.split(None, 1)
        dst, *src = [a.strip() for a in rest.split(",")]
        args = [value(a) for a in src]
        if op.startswith("dp4a."):
            _, ta, tb = op.split(".")
            prods = (
                _byte(args[0], i, ta == "s32") * _byte(args[1], i, tb == "s32") for i in range(4)
            )
            result = args[2] + sum(prods)
        else:
            result = OPS[op](*args)
        if dst.startswith("$"):
            operands[int(dst[1:])] = result & M32
        else:
            regs[dst] = result & M32
    return operands


def _x_bytes(x: torch.Tensor) -> tuple[list[int], float, float]:
    """32 bf16 values -> (16 words, the scale's inverse, sum v) by ``_X4_ASM``."""
    h = x.to(torch.bfloat16).view(torch.int16).numpy().astype(np.int64) & 0xFFFF
    out = _run(asm._X4_ASM.value, {18 + i: int(h[2 * i] | h[2 * i + 1] << 16) for i in range(16)})
    return [out[i] for i in range(16)], _f32(out[16]), _f32(out[17])


def _chain(words: list[int], xo: list[int]) -> float:
    ops = {1 + i: w for i, w in enumerate(words)} | {5 + i: x for i, x in enumerate(xo)}
    return _f32(_run(asm._DP4A_ASM.value, ops)[0])


def _element(gen: torch.Generator, x: torch.Tensor) -> None:
    q = torch.randint(0, 16, (32,), generator=gen)
    words = [sum(int(q[8 * w + j]) << (4 * j) for j in range(8)) for w in range(4)]
    xo, up, xsum = _x_bytes(x)
    xb = x.to(torch.bfloat16).double()
    z = float(torch.rand(1, generator=gen)) * 15  # fractional, as GGUF Q4_1's
    got = _chain(words, xo) * up - z * (xsum * up)
    want = float(((q.double() - z) * xb).sum())
    # x's fixed point: steps of at most 2^-14 of max |x|, rounded to the nearest
    bound = 2.0**-15 * float(xb.abs().max()) * float((q.double() - z).abs().sum())
    assert abs(got - want) <= bound + 1e-9 * abs(want) + 1e-300, (got, want, bound)
    # the integer sum is exact: sum q v over the fixed-point values the bytes encode
    v = [(_byte(xo[4 * (j // 8) + (j % 2)], (j % 8) // 2, True) << 8)
         + _byte(xo[4 * (j // 8) + 2 + (j % 2)], (j % 8) // 2, False) for j in range(32)]  # fmt: skip
    assert _chain(words, xo) == sum(int(q[j]) * v[j] for j in range(32))
    assert xsum == sum(v)
    top = float(xb.abs().max())
    assert all(abs(v[j] * up - float(xb[j])) <= 2.0**-15 * top for j in range(32))
    # exact within 2^7 of the largest (a bf16 has 8 significant bits)
    assert all(v[j] * up == float(xb[j]) for j in range(32) if abs(float(xb[j])) >= top / 128)


@pytest.mark.parametrize("case", ["normal", "outlier", "negative", "tiny", "huge", "zeros"])
def test_the_ptx_sums_match_the_dot_product(case):
    gen = torch.Generator().manual_seed(hash(case) % 1000)
    for _ in range(12):
        x = torch.randn(32, generator=gen)
        if case == "outlier":
            x[int(torch.randint(0, 32, (1,), generator=gen))] = 3000.0
        elif case == "negative":
            x = -x.abs()
        elif case == "tiny":
            x = x * 1e-30
        elif case == "huge":
            x = x * 1e30
        elif case == "zeros":
            x = torch.zeros(32)
        _element(gen, x)


def test_the_largest_magnitudes_are_exact():
    # all nibbles 15 against v = +-32,640 (the largest a bf16 scales to): 2^24 is not reached
    for sign in (1.0, -1.0):
        x = torch.full((32,), sign * 1.9921875)
        xo, up, xsum = _x_bytes(x)
        words = [0xFFFFFFFF] * 4
        assert _chain(words, xo) * up == pytest.approx(15 * 32 * sign * 1.9921875, rel=0)
        assert xsum * up == 32 * sign * 1.9921875


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_nan_or_an_infinity_reaches_the_output(bad):
    x = torch.randn(32, generator=torch.Generator().manual_seed(1))
    x[5] = bad
    xo, up, xsum = _x_bytes(x)
    assert np.isnan(up)
    assert np.isnan(_chain([0x12345678] * 4, xo) * up - 3.0 * (xsum * up))
