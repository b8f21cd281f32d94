"""Offline (no GPU): the inner loop of a decode attention over an fp8 KV cache with both
dots as Hopper's fp8 wgmma (QGMMA), compiled for sm_90, its instructions per KV byte.

Session 28's question for the fp8 + fp8-KV throughput target (bound by the decode
attention at 57% of its KV floor; docs/quantization.md). The shipped kernel converts each
fp8 tile to f16 for HMMA (``sass_loop.py decode-fp8``: 3.41 instructions per KV byte on
2026-12-04, paging, scales and masks included; 2.8 in session 8). An fp8
dot needs 64 rows on the MMA's M side and both operands K-major (the reduction dimension
contiguous). Two orientations of one tile step (online softmax, paging and scales left
out, as they cost the same in both):

- ``heads``: q padded to 64 rows as M (a group has 4 query heads): S = q K^T, O = P V.
  The softmax then runs over 16x the real rows, and V ([tokens, D], D contiguous) is not
  K-major for P V, so Triton transposes it through shared memory byte by byte.
- ``tokens``: the tile's tokens as M, the heads padded to 16 as N: S^T = K q^T, O^T = V^T
  P^T. K ([tokens, D]) is K-major for the first dot; with ``VT`` the V cache is stored
  transposed per page ([D, tokens]), K-major for the second.

    python scripts/fp8_mma_tile.py   (needs triton >= 3.6 on the path: its ptxas)

Read on 2026-12-04 (Triton 3.6, 4 warps, 2 stages; KV bytes = BLOCK_N x 128 x 2):
heads 64/128: 3.83 / 3.21 per KV byte (163 / 247 registers); tokens, V as stored: 3.07 /
2.30; **tokens, V transposed: 2.08 / 1.45** (80 / 96 registers, K and V tiles by
LDGSTS into shared memory, no conversion). Without the paging, the per-token scales and
the masks, which the shipped kernel pays for (an estimate, not compiled: a few tenths per
KV byte). Not timed on a GPU. q and P enter the dots as e4m3 here (the shipped kernel
keeps them f16): a quality question for the KV-cache eval before any speed one.
"""

from __future__ import annotations

import collections
import os
import sys

import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
from sass_loop import compile_sm90, hottest_loop  # noqa: E402


@triton.jit
def _heads_as_m(q_ptr, k_ptr, v_ptr, o_ptr, n_tokens, stride_tok, stride_vd,
                H: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, VT: tl.constexpr):  # fmt: skip
    offs_h, offs_d = tl.arange(0, H), tl.arange(0, D)
    q = tl.load(q_ptr + offs_h[:, None] * D + offs_d[None, :])  # [H, D] fp8
    m_i = tl.full([H], float("-inf"), tl.float32)
    l_i = tl.zeros([H], tl.float32)
    acc = tl.zeros([H, D], tl.float32)
    for n0 in range(0, n_tokens, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k = tl.load(k_ptr + offs_n[None, :] * stride_tok + offs_d[:, None])  # [D, N]
        s = tl.dot(q, k)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + offs_n[:, None] * stride_tok + offs_d[None, :])  # [N, D]
        acc = acc * alpha[:, None] + tl.dot((p * 256.0).to(tl.float8e4nv), v)
        m_i = m_new
    tl.store(o_ptr + offs_h[:, None] * D + offs_d[None, :], acc / l_i[:, None])


@triton.jit
def _tokens_as_m(q_ptr, k_ptr, v_ptr, o_ptr, n_tokens, stride_tok, stride_vd,
                 H: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, VT: tl.constexpr):  # fmt: skip
    offs_h, offs_d = tl.arange(0, H), tl.arange(0, D)
    qt = tl.load(q_ptr + offs_h[None, :] * D + offs_d[:, None])  # [D, H] fp8
    m_i = tl.full([H], float("-inf"), tl.float32)
    l_i = tl.zeros([H], tl.float32)
    acc = tl.zeros([D, H], tl.float32)  # O^T
    for n0 in range(0, n_tokens, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k = tl.load(k_ptr + offs_n[:, None] * stride_tok + offs_d[None, :])  # [N, D]
        st = tl.dot(k, qt)  # [N, H]
        m_new = tl.maximum(m_i, tl.max(st, 0))
        pt = tl.exp2(st - m_new[None, :])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(pt, 0)
        if VT:  # the V cache stored transposed: [D, tokens]
            vt = tl.load(v_ptr + offs_d[:, None] * stride_vd + offs_n[None, :])
        else:
            vt = tl.trans(tl.load(v_ptr + offs_n[:, None] * stride_tok + offs_d[None, :]))
        acc = acc * alpha[None, :] + tl.dot(vt, (pt * 256.0).to(tl.float8e4nv))
        m_i = m_new
    tl.store(o_ptr + offs_h[None, :] * D + offs_d[:, None], acc / l_i[None, :])


def main() -> None:
    sig = {"q_ptr": "*fp8e4nv", "k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv", "o_ptr": "*fp32",
           "n_tokens": "i32", "stride_tok": "i32", "stride_vd": "i32"}  # fmt: skip
    divisible = ["q_ptr", "k_ptr", "v_ptr", "o_ptr", "stride_tok", "stride_vd"]
    cases = [("heads", _heads_as_m, 64, False), ("tokens", _tokens_as_m, 16, False),
             ("tokens, V transposed", _tokens_as_m, 16, True)]  # fmt: skip
    for name, fn, heads, vt in cases:
        for block_n in (64, 128):
            consts = dict(H=heads, D=128, BLOCK_N=block_n, VT=vt)
            sass, res, _ = compile_sm90(fn, sig, consts, divisible, 4, 2)
            loop = hottest_loop(sass)
            counts = collections.Counter(op for _, op in loop)
            regs = res.split("REG:")[1].split()[0] if "REG:" in res else "?"
            per_byte = len(loop) * 128 / (block_n * 128 * 2)
            mma = {k: v for k, v in counts.items() if "MMA" in k}
            print(f"{name:22s} BLOCK_N={block_n:3d}: {per_byte:.2f} per KV byte, "
                  f"{regs} registers, {mma}")  # fmt: skip
            print("   ", " ".join(f"{k}:{v}" for k, v in counts.most_common(10)))


if __name__ == "__main__":
    main()
