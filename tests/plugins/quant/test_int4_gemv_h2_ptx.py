"""The PTX of ``int4_gemv_h2`` (``H2_ASM``, ``X_ASM``) run by a small interpreter of the
instructions it uses, on the CPU: every nibble of a word meets its own activation once,
as ``q - 8``, and the x pairs carry ``x * 2^-shift``. The GPU tests run the real thing;
these pin the strings' constants and operand order where no GPU is."""

from __future__ import annotations

import random
import re
import struct

import numpy as np
import pytest
import torch

from tokenloom.plugins.quant.kernels.int4_gemv_h2 import H2_ASM, X_ASM


def _f16(bits: int) -> float:
    return float(np.array([bits & 0xFFFF], np.uint16).view(np.float16)[0])


def _f16_bits(value: float) -> int:
    return int(np.array([value], np.float16).view(np.uint16)[0])


def _bf16(bits: int) -> float:
    return _f32((bits & 0xFFFF) << 16)


def _bf16_bits(value: float) -> int:
    return int(torch.tensor([value], dtype=torch.float32).bfloat16().view(torch.int16)) & 0xFFFF


def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]


def _f32_bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", np.float32(value)))[0]


def _halves(op, *regs: int) -> int:
    """Apply ``op`` to the low and the high halves of 32-bit registers."""
    lo = op(*(r & 0xFFFF for r in regs))
    hi = op(*(r >> 16 for r in regs))
    return (hi << 16) | lo


def run_ptx(asm: str, args: list[int], n_out: int) -> list[int]:
    """Execute ``asm`` (the subset the kernel uses) on 32-bit patterns ``args`` ($n_out...)
    and return the outputs $0..$(n_out - 1)."""
    regs: dict[str, int] = {f"${n_out + i}": a & 0xFFFFFFFF for i, a in enumerate(args)}

    def val(token: str) -> int:
        token = token.strip()
        return int(token, 16) if token.startswith("0x") else regs[token]

    for inst in asm.strip().strip("{}").split(";"):
        inst = inst.strip()
        if not inst or inst.startswith(".reg"):
            continue
        op, rest = inst.split(None, 1)
        if op == "mov.b32" and rest.startswith("{"):
            lo, hi, src = re.match(r"\{(\w+), (\w+)\}, (\w+)", rest).groups()
            regs[lo], regs[hi] = regs[src] & 0xFFFF, regs[src] >> 16
            continue
        d, *ops = [t.strip() for t in rest.split(",")]
        if op == "mov.b32":
            out = val(ops[0])
        elif op == "shr.u32":
            out = val(ops[0]) >> int(ops[1])
        elif op == "shl.b32":
            out = (val(ops[0]) << int(ops[1])) & 0xFFFFFFFF
        elif op == "and.b32":
            out = val(ops[0]) & val(ops[1])
        elif op == "lop3.b32":
            assert ops[3] == "0xEA", ops  # (a & b) | c
            out = (val(ops[0]) & val(ops[1])) | val(ops[2])
        elif op == "sub.f16x2":
            out = _halves(lambda a, b: _f16_bits(_f16(a) - _f16(b)), val(ops[0]), val(ops[1]))
        elif op == "mul.f16x2":
            out = _halves(lambda a, b: _f16_bits(_f16(a) * _f16(b)), val(ops[0]), val(ops[1]))
        elif op == "fma.rn.f16x2":  # one rounding: the product is exact in double
            out = _halves(
                lambda a, b, c: _f16_bits(_f16(a) * _f16(b) + _f16(c)), *(val(o) for o in ops)
            )
        elif op == "mul.rn.bf16x2":
            out = _halves(lambda a, b: _bf16_bits(_bf16(a) * _bf16(b)), val(ops[0]), val(ops[1]))
        elif op == "cvt.f32.f16":
            out = _f32_bits(_f16(val(ops[0])))
        elif op == "cvt.rn.f16x2.f32":  # the first source goes to the upper half
            out = (_f16_bits(_f32(val(ops[0]))) << 16) | _f16_bits(_f32(val(ops[1])))
        elif op == "add.f32":
            out = _f32_bits(np.float32(_f32(val(ops[0]))) + np.float32(_f32(val(ops[1]))))
        else:
            raise AssertionError(f"instruction outside the subset: {op}")
        regs[d] = out & 0xFFFFFFFF
    return [regs[f"${i}"] for i in range(n_out)]


def x_pairs(x8: list[float], shift: int) -> tuple[list[int], float]:
    """``X_ASM`` on eight bf16 activations: four f16x2 pairs and the scaled sum."""
    half = (127 - shift) << 7
    words = [_bf16_bits(x8[2 * i]) | (_bf16_bits(x8[2 * i + 1]) << 16) for i in range(4)]
    out = run_ptx(X_ASM.value, [*words, (half << 16) | half], 5)
    return out[:4], _f32(out[4])


def h2_dot(word_a: int, word_b: int, xa: list[int], xb: list[int]) -> float:
    return _f32(run_ptx(H2_ASM.value, [word_a, word_b, *xa, *xb], 1)[0])


def _word(nibbles) -> int:
    return sum(int(q) << (4 * j) for j, q in enumerate(nibbles))


@pytest.mark.parametrize("position", range(8))
def test_each_nibble_meets_its_own_activation_as_q_minus_8(position):
    x = [float(2**j) for j in range(8)]  # distinct powers of two: exact in f16
    xa, xsum = x_pairs(x, 0)
    assert xsum == sum(x)
    zero = [0, 0, 0, 0]
    for q in range(16):
        nibbles = [8] * 8  # q - 8 = 0 elsewhere
        nibbles[position] = q
        got = h2_dot(_word(nibbles), _word([8] * 8), xa, zero)
        assert got == (q - 8) * x[position], (position, q, got)


@pytest.mark.parametrize("shift", [4, -3, 11])
def test_random_words_against_the_sum_of_products(shift):
    rng = random.Random(shift)
    for _ in range(50):
        q = [rng.randrange(16) for _ in range(16)]
        x = [
            float(torch.tensor(rng.gauss(0, 1) * 2.0 ** (shift + 3)).bfloat16()) for _ in range(16)
        ]
        xa, sa = x_pairs(x[:8], shift)
        xb, sb = x_pairs(x[8:], shift)
        got = h2_dot(_word(q[:8]), _word(q[8:]), xa, xb) * 2.0**shift
        expected = sum((qi - 8) * xi for qi, xi in zip(q, x, strict=True))
        scale = sum(abs((qi - 8) * xi) for qi, xi in zip(q, x, strict=True))
        assert abs(got - expected) <= 2e-3 * scale, (got, expected)
        assert abs((sa + sb) * 2.0**shift - sum(x)) <= 1e-5 * sum(abs(v) for v in x)
