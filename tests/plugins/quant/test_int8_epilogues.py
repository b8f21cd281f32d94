"""The one-row int8 GEMV's epilogues (``int8_gemv_nk`` with ``one_row_epilogue``, session
27): SiLU-and-mul of a merged gate/up projection equals ``silu(gate) * up`` of the
dequantized reference; the rope epilogue of a merged q/k/v projection equals, to the
bit, the same GEMV then the rope kernel writing the cache; the kernel serves only the
calls it fits; an int8 Llama decodes the same tokens with them (and with the o
projection's early release) as without. In the interpreter on the CPU (fp32, fp16), its
PTX on the GPU at the Llama-3-8B shapes (bf16)."""

from __future__ import annotations

import pytest
import torch
from test_int4_gemv_nk import _silu_err
from test_int4_qkv_rope import _rope, rope_kernel
from test_int8_gemv_nk import CUDA, DEVICE, _layer

from tokenloom.plugins.quant.int8 import Int8Kernel
from tokenloom.plugins.quant.kernels.dispatch import NK, bucket
from tokenloom.plugins.quant.kernels.gemm_config import GemmConfig
from tokenloom.plugins.quant.kernels.int8_gemv_nk import int8_nk_fused, launch_int8_nk

DTYPES = [torch.bfloat16] if CUDA else [torch.float32, torch.float16]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _x(k, dtype, scale=3.0, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(1, k, generator=gen) * scale).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("n", "k", "block_n", "block_k"),
    [
        (64, 512, 16, 256),  # gate and up 32 rows apart, K over two tiles
        (44, 576, 8, 512),  # 22 outputs: the last program's masked; a partial last tile
        (40, 96, 4, 1024),  # two outputs a program; the tile wider than K
    ],
)
@pytest.mark.parametrize("biased", [False, True])
def test_silu_in_the_epilogue_matches_silu_of_the_reference(dtype, n, k, block_n, block_k, biased):
    qweight, scales, ref = _layer(n, k)
    x = _x(k, dtype)
    bias = torch.randn(n).to(DEVICE, dtype)
    args = (x, qweight, scales)
    tol = max(TOL[dtype], 5e-4 if biased else 0.0)  # the biased weights: ~1e-4 of |y|
    y = launch_int8_nk(*args, bias, block_n, block_k, 4, 1, biased, silu=True)
    assert y.shape == (1, n // 2) and y.dtype == dtype
    assert _silu_err(y, x, ref, bias) < tol
    y0 = launch_int8_nk(*args, None, block_n, block_k, 4, 1, biased, silu=True)
    assert _silu_err(y0, x, ref) < tol
    # not the plain GEMV's first half: the gate rows meet their own up rows
    plain = launch_int8_nk(*args, None, block_n, block_k, 4, 1, biased)
    assert not torch.allclose(y0, plain[:, : n // 2])


def _check_rope(x, qweight, scales, bias, tiling, biased, rope):
    """The epilogue against the GEMV then ``rope_ops.qk_norm_rope_``, to the bit."""
    block_n, block_k, warps = tiling
    args = (x, qweight, scales, bias, block_n, block_k, warps, 1, biased)
    y = launch_int8_nk(*args, rope=rope)
    expected = launch_int8_nk(*args)
    k_cache, v_cache = rope_kernel(expected, rope)
    assert torch.equal(y, expected)
    assert torch.equal(rope.k_cache, k_cache) and torch.equal(rope.v_cache, v_cache)
    return y


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tiling", [(16, 128, 4), (32, 256, 4), (16, 1024, 2)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_rope_epilogue_equals_the_gemv_then_the_rope_kernel(dtype, tiling, bias):
    hq, hkv, d, k = 4, 2, 32, 256
    n = (hq + 2 * hkv) * d
    qweight, scales, _ = _layer(n, k)
    b = torch.randn(n).to(DEVICE, dtype) if bias else None
    rope = _rope(dtype, hq, hkv, d, slot=6)
    y = _check_rope(_x(k, dtype), qweight, scales, b, tiling, True, rope)
    flat_k = rope.k_cache.view(-1, hkv, d)
    assert torch.equal(flat_k[6], y[0, hq * d : (hq + hkv) * d].view(hkv, d))  # rotated k
    assert not flat_k[:6].any() and not flat_k[7:].any()  # only the token's slot
    assert torch.equal(rope.v_cache.view(-1, hkv, d)[6], y[0, (hq + hkv) * d :].view(hkv, d))


def test_it_serves_only_the_calls_it_fits(monkeypatch):
    hq, hkv, d, k = 4, 2, 32, 256
    n = (hq + 2 * hkv) * d
    qweight, scales, ref = _layer(n, k)
    x, rope = _x(k, DTYPES[0]), _rope(DTYPES[0], hq, hkv, d, slot=0)
    nk = GemmConfig(1, 16, 256, 1, 4, 3, nk=True, biased=True)
    args = (x, qweight, scales, None)
    monkeypatch.delenv("TOKENLOOM_INT8_EPILOGUES", raising=False)
    assert int8_nk_fused(*args, nk, rope=rope) is not None  # on by default
    y = int8_nk_fused(*args, nk, silu=True)
    assert y is not None and y.shape == (1, n // 2) and _silu_err(y, x, ref) < 5e-4
    assert int8_nk_fused(*args, GemmConfig(1, 8, 256, 1, 4, 3, nk=True), rope=rope) is None
    assert int8_nk_fused(*args, GemmConfig(1, 64, 128, 1, 4, 3), silu=True) is None  # a tile
    rows2 = GemmConfig(1, 16, 256, 1, 4, 3, nk=True, rows=2)
    assert int8_nk_fused(*args, rows2, silu=True) is None
    two = (torch.cat([x, x]), qweight, scales, None)
    assert int8_nk_fused(*two, nk, silu=True) is None  # one row only
    monkeypatch.setenv("TOKENLOOM_INT8_EPILOGUES", "0")
    assert int8_nk_fused(*args, nk, silu=True) is None
    assert int8_nk_fused(*args, nk, rope=rope) is None


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("cfg", NK)
def test_gpu_silu_at_llama_3_8b_gate_up(cfg):
    n, k = 28672, 4096
    qweight, scales, ref = _layer(n, k)
    x = _x(k, torch.bfloat16)
    y = int8_nk_fused(x, qweight, scales, None, cfg, silu=True)
    assert y is not None and _silu_err(y, x, ref) < 4e-3


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("tiling", [(16, 1024, 4), (16, 2048, 8), (32, 1024, 4)])
@pytest.mark.parametrize("biased", [False, True])
def test_gpu_the_rope_epilogue_at_llama_3_8b_equals_the_unfused_path(tiling, biased):
    hq, hkv, d, k = 32, 8, 128, 4096
    qweight, scales, _ = _layer((hq + 2 * hkv) * d, k)
    rope = _rope(torch.bfloat16, hq, hkv, d, slot=9)
    _check_rope(_x(k, torch.bfloat16, 3e3), qweight, scales, None, tiling, biased, rope)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_gpu_the_int8_kernel_fuses_at_one_row_only(monkeypatch):
    n, k = 2048, 1024
    w = torch.randn(n, k, device="cuda") * 0.02
    from tokenloom.plugins.quant.int8 import quantize_int8

    kernel = Int8Kernel(*quantize_int8(w), torch.bfloat16)
    nk = GemmConfig(1, 16, 1024, 1, 4, 3, nk=True, biased=True)
    kernel.configs = tuple(nk if i == bucket(1) else c for i, c in enumerate(kernel.configs))
    x = _x(k, torch.bfloat16)
    y = kernel.apply_silu_and_mul(x, None)
    ref = kernel.reference(torch.eye(k, device="cuda", dtype=torch.float32), None).t().double()
    assert y is not None and _silu_err(y, x, ref) < 4e-3
    assert kernel.apply_silu_and_mul(torch.cat([x, x]), None) is None
    monkeypatch.setenv("TOKENLOOM_INT8_EPILOGUES", "0")
    assert kernel.apply_silu_and_mul(x, None) is None


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("eager", [True, False])
def test_gpu_an_int8_llama_decodes_the_same_tokens_with_the_epilogues(
    int4_llama_tokens, monkeypatch, spy_early, eager
):
    # eager: every gate/up, q/k/v and o one-row tiling forced to int8_gemv_nk (one layer
    # kind at a time: the fixture forces one); graphs: as tuned, captured
    from tokenloom.plugins.quant.kernels import int8_gemv_nk

    fused: list[tuple[str, bool]] = []  # (the epilogue asked for, whether it ran)
    original = int8_gemv_nk.int8_nk_fused

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        y = original(*args, **kwargs)
        fused.append(("rope" if kwargs.get("rope") is not None else "silu", y is not None))
        return y

    monkeypatch.setattr(int8_gemv_nk, "int8_nk_fused", counting)
    early = spy_early(int8_gemv_nk)
    # q/k/v's rope epilogue and o's early release give the unfused path's bits: the same
    # tokens; SiLU's (gate and up not rounded to bf16 first) may differ in the last bits
    for projection, epilogue in (("qkv_proj", "rope"), ("o_proj", None), ("gate_up_proj", "silu")):
        fused.clear()
        early.clear()
        monkeypatch.setenv("TOKENLOOM_INT8_EPILOGUES", "1")
        monkeypatch.setenv("TOKENLOOM_O_EARLY_RELEASE", "1")
        on = int4_llama_tokens(eager, projection, "int8")
        if eager and epilogue is not None:  # forced: the epilogue ran
            assert (epilogue, True) in fused, (projection, fused)
        if eager and projection == "o_proj":  # forced: the o GEMVs took the early release
            assert early, projection
        if projection == "gate_up_proj":  # graphs: fused where the tuner chose the nk GEMV
            assert all(len(t) == 24 for t in on)
            continue
        monkeypatch.setenv("TOKENLOOM_INT8_EPILOGUES", "0")
        monkeypatch.setenv("TOKENLOOM_O_EARLY_RELEASE", "0")
        assert int4_llama_tokens(eager, projection, "int8") == on, projection
