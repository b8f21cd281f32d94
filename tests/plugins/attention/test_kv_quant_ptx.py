"""The quantized KV writes compile to the reference's arithmetic on an H100/H200.

Compiled for sm_90 here, no GPU needed: the PTX divides with ``div.rn.f32`` (IEEE,
as torch's tensor division) and never with ``div.full.f32`` / ``div.approx.f32``
(Triton's ``/``), and the scale multiplies by fp32(1 / QMAX) (``kv_quant.INV_QMAX``).
The approximate divisions put int8 values next to a .5 tie one step off the
reference (issue 12: 15 of 46M values at decode shapes, 349 of 4.7M at prefill);
the interpreter divides exactly, so only the compiled code shows them.
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import triton

from tokenloom.plugins.attention import kv_quant
from tokenloom.plugins.attention.triton_kernels import kv_write
from tokenloom.plugins.models import rope_ops

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
pytestmark = pytest.mark.skipif(not PTXAS.exists(), reason="Triton's NVIDIA backend is absent")
QMAX = {"i8": 127.0, "fp8e4nv": 448.0}


def compile_ptx(
    fn, pointers: dict[str, str], constexprs: dict[str, object], float_args=frozenset({"eps"})
) -> str:
    """``fn`` compiled for sm_90: pointer args typed by ``pointers`` (name -> element
    type), ``float_args`` fp32, the other runtime args i32."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = "*" + pointers[name]
        else:
            signature[name] = "fp32" if name in float_args else "i32"
    index = {name: i for i, name in enumerate(fn.arg_names)}
    source = ASTSource(
        fn=fn, signature=signature, constexprs={(index[k],): v for k, v in constexprs.items()}
    )
    return triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]


def fp32_hex(value: float) -> str:
    """How PTX writes an fp32 immediate: ``0f`` and the bits in hex."""
    return "0f" + struct.pack(">f", value).hex().upper()


def divisions(ptx: str) -> set[str]:
    return set(re.findall(r"\bdiv\.[a-z]+\.f32\b", ptx))


def kv_write_ptx(cache: str) -> str:
    pointers = dict.fromkeys(["k_ptr", "v_ptr"], "bf16")
    pointers |= dict.fromkeys(["k_cache_ptr", "v_cache_ptr"], cache)
    pointers |= {"k_scale_ptr": "fp32", "v_scale_ptr": "fp32", "slot_mapping_ptr": "i64"}
    return compile_ptx(
        kv_write._kv_write_quant_kernel,
        pointers,
        dict(
            NUM_KV_HEADS=8,
            HEAD_DIM=128,
            HEADS_P2=8,
            BLOCK_D=128,
            PAGE_SIZE=16,
            QMAX=QMAX[cache],
            IS_INT8=cache == "i8",
        ),  # fmt: skip
    )


def fused_rope_ptx(cache: str) -> str:
    pointers = dict.fromkeys(["q_ptr", "k_ptr", "qw_ptr", "kw_ptr", "v_ptr"], "bf16")
    pointers |= {"cos_ptr": "bf16", "sin_ptr": "bf16", "slot_ptr": "i64"}
    pointers |= dict.fromkeys(["k_cache_ptr", "v_cache_ptr"], cache)
    pointers |= {"k_scale_ptr": "fp32", "v_scale_ptr": "fp32"}
    return compile_ptx(
        rope_ops._qk_norm_rope_kernel,
        pointers,
        dict(
            NUM_Q=32,
            NUM_K=8,
            Q_P2=32,
            K_P2=8,
            HALF=64,
            HAS_NORM=False,
            WRITE_KV=True,
            KV_QUANT=True,
            PAGE_SIZE=16,
            QMAX=QMAX[cache],
            IS_INT8=cache == "i8",
        ),  # fmt: skip
    )


def decode_ptx(cache: str, rope: bool = False, norm: bool = False) -> str:
    from tokenloom.plugins.attention.triton_kernels import decode

    pointers = {"q_ptr": "bf16", "out_ptr": "bf16", "k_cache_ptr": cache, "v_cache_ptr": cache}
    quantized = cache != "bf16"
    if rope:
        pointers |= dict.fromkeys(["k_new_ptr", "v_new_ptr", "cos_ptr", "sin_ptr"], "bf16")
        pointers |= {"q_norm_ptr": "bf16", "k_norm_ptr": "bf16", "slot_ptr": "i64"}
    pointers |= dict.fromkeys(
        ["part_out_ptr", "part_lse_ptr", "k_scale_ptr", "v_scale_ptr"], "fp32"
    )
    pointers |= {"block_tables_ptr": "i32", "seq_lens_ptr": "i32", "counters_ptr": "i32"}
    constexprs = dict(
        NUM_HEADS=32, NUM_KV_HEADS=8, GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_H=16,
        BLOCK_N=128, PAGE_SIZE=16, DOT_PRECISION="tf32", KV_QUANT=quantized, KV_F16=quantized,
        KV_ASM=quantized, HEADS_FIRST=True, P_LIFT=128.0, ROPE=rope, HAS_NORM=norm, HALF=64,
        PREFETCH=False,
    )  # fmt: skip
    return compile_ptx(
        decode._decode_kernel, pointers, constexprs, float_args={"scale_log2", "eps"}
    )


VARIANTS = {
    f"{kind}-{cache}": (kind, cache) for kind in ("kv_write", "fused_rope") for cache in QMAX
}


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    """Each variant's divisions and fp32 immediates. In a subprocess: the tests run
    under TRITON_INTERPRET=1, where ``triton.jit`` gives interpreted functions."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # as the engine runs (Triton's default)
    run = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_quantized_kv_write_divides_as_ieee_and_scales_by_the_reciprocal(compiled, variant):
    _, cache = VARIANTS[variant]
    dtype = kv_quant.KV_DTYPES["int8" if cache == "i8" else "fp8"]
    assert compiled[variant]["divisions"] == ["div.rn.f32"]
    assert fp32_hex(kv_quant.INV_QMAX[dtype]) in compiled[variant]["immediates"]


@pytest.mark.parametrize("cache", sorted(QMAX))
def test_decode_converts_an_8_bit_tile_before_its_layout_change(compiled, cache):
    """The decode kernel reads an 8-bit cache tile from shared memory as f16 through
    ``ldmatrix``, never value by value (``ld.shared.b8`` / ``.s8``: what Triton emits
    when it moves the layout change above a pure conversion, 2x the kernel's
    instructions per KV byte on the H200)."""
    loads = compiled[f"decode-{cache}"]["shared_loads"]
    assert not [op for op in loads if re.search(r"\.[bsu]8$", op)], loads
    assert any(op.startswith("ldmatrix") for op in loads)
    assert compiled[f"decode-{cache}"]["conversions"] >= 128


def test_decode_with_rope_compiles_for_sm90_with_its_barrier(compiled):
    """The rope variants (bf16 cache; with and without Qwen3's q/k norm) compile for the
    H200, and the last split's store of the new key and value is followed by a block
    barrier: without the norm (whose reductions bring barriers of their own) the rope
    variant has exactly one more than the plain kernel."""
    assert compiled["decode-rope-nonorm"]["barriers"] == compiled["decode-bf16"]["barriers"] + 1
    for name in ("decode-rope", "decode-rope-nonorm"):
        assert any(op.startswith("ldmatrix") for op in compiled[name]["shared_loads"])


if __name__ == "__main__":
    build = {"kv_write": kv_write_ptx, "fused_rope": fused_rope_ptx}
    summary = {}
    for name, (kind, cache) in VARIANTS.items():
        ptx = build[kind](cache)
        summary[name] = {
            "divisions": sorted(divisions(ptx)),
            "immediates": sorted(set(re.findall(r"\b0f[0-9A-F]{8}\b", ptx))),
        }
    for cache in QMAX:
        ptx = decode_ptx(cache)
        summary[f"decode-{cache}"] = {
            "shared_loads": sorted(set(re.findall(r"\b(?:ld\.shared|ldmatrix)[\w.]*", ptx))),
            "conversions": len(re.findall(r"cvt\.rn\.f16x2\.e4m3x2|sub\.f16x2", ptx)),
        }
    for name, rope, norm in (
        ("decode-rope", True, True), ("decode-rope-nonorm", True, False), ("decode-bf16", False, False),
    ):  # fmt: skip
        ptx = decode_ptx("bf16", rope=rope, norm=norm)
        summary[name] = {
            "barriers": len(re.findall(r"\bbar\.sync\b|\bbarrier\.sync\b", ptx)),
            "shared_loads": sorted(set(re.findall(r"\b(?:ld\.shared|ldmatrix)[\w.]*", ptx))),
        }
    print(json.dumps(summary))
