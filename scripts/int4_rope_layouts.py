"""Offline check (no GPU) that the int4 q/k/v GEMV's rope epilogue keeps the plain
kernel's accumulator layout, so that its sums run in the same order and its outputs are
the unfused path's to the bit (``kernels/int4_qkv_rope.py``, session 24).

Compiles ``_int4_gemv_nk_kernel`` for sm_90 with and without ``ROPE`` at the Llama-3-8B
q/k/v shape (K = 4096; heads of 128) for several tilings, and compares Triton's TTGIR
from 60 lines before the row reduction to it, and the first layout. Use the GPU host's
Triton: ``pip install --no-deps --target /tmp/t36 triton==3.6.0``, then
``PYTHONPATH=/tmp/t36 python scripts/int4_rope_layouts.py``.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from sass_loop import compile_sm90  # noqa: E402

from tokenloom.plugins.quant.kernels.int4_gemv_nk import _int4_gemv_nk_kernel  # noqa: E402

ROPE_ARGS = ("cos_ptr", "sin_ptr", "k_cache_ptr", "v_cache_ptr")


def ttgir(block_n: int, block_kw: int, warps: int, kw: int, dp4a: bool, rope: bool) -> str:
    sig = {n: "*bf16" for n in ("x_ptr", "s_ptr", "z_ptr", "b_ptr", "y_ptr")}
    sig.update(qw_ptr="*i32", N="i32")
    consts: dict[str, object] = dict(
        KW=kw, EVEN=True, GROUP=128, HAS_BIAS=False, BLOCK_N=block_n, BLOCK_KW=block_kw,
        ASM=True, USE_PDL=True, DP4A=dp4a, ONE_TILE=kw <= block_kw,
    )  # fmt: skip
    if rope:
        consts.update(ROPE=True, HEAD_DIM=128, NUM_Q=32, NUM_KV=8)
        sig.update({n: "*bf16" for n in ROPE_ARGS}, slot_ptr="*i64")
    else:
        consts.update({n: None for n in (*ROPE_ARGS, "slot_ptr")})
    with tempfile.NamedTemporaryFile(suffix=".ttgir") as f:
        os.environ["TTGIR"] = f.name
        compile_sm90(_int4_gemv_nk_kernel, sig, consts, list(sig), warps, 1)
        return open(f.name).read()


def before_reduction(text: str) -> list[str]:
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if 'tt.reduce"' in line)
    body = lines[max(0, at - 60) : at + 4]
    return [lines[0]] + [re.sub(r"loc\([^)]*\)+|#loc\d*|%[\w#]+", "", x) for x in body]


if __name__ == "__main__":
    for block_n, block_kw, warps, kw in [(8, 512, 4, 512), (16, 512, 4, 512), (32, 512, 4, 512),
                                         (16, 256, 2, 512), (16, 256, 4, 512)]:  # fmt: skip
        for dp4a in (False, True):
            same = before_reduction(ttgir(block_n, block_kw, warps, kw, dp4a, False)) == (
                before_reduction(ttgir(block_n, block_kw, warps, kw, dp4a, True))
            )
            tiling = f"{block_n} x {block_kw * 8} / {warps}, K = {kw * 8}"
            print(tiling, "dp4a" if dp4a else "f16x2", "same" if same else "DIFFERENT")
