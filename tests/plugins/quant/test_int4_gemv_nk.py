"""The one-row int4 GEMV over row-major words (``int4_gemv_nk``) equals the dequantized
reference: its structure (indexing, masks, the group epilogue) in fp32 in the interpreter
on the CPU, its PTX on the GPU (bf16) at the Llama-3-8B shapes, where the range guard per
32 values keeps the f16 chains finite and precise under any activation, and the integer
path (``dp4a``) the same; it serves only the calls it fits. The integer path's PTX is also
run on the CPU, in an emulator (``test_int4_dp4a_ptx.py``)."""

from __future__ import annotations

import pytest
import torch
from test_int4_gemv_h2 import _rel_err, _x

from tokenloom.plugins.quant.int4 import dequantize_int4, quantize_int4
from tokenloom.plugins.quant.kernels.dispatch import (
    INT4_NK,
    INT4_NK_DP4A,
    INT4_NK_MMA,
    INT4_NK_WIDE,
    candidates,
)
from tokenloom.plugins.quant.kernels.int4_gemv_nk import (
    int4_nk_fits,
    int4_nk_serves,
    launch_int4_nk,
)
from tokenloom.plugins.quant.kernels.int4_tiles import int4_row_major

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.bfloat16] if CUDA else [torch.float32, torch.float16]
# GPU: f16 chains of 16 products (~5e-4 of |y|) and the bf16 output's rounding
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 4e-3}


def _layer(n, k, group=128, fractional=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.02
    qweight, scales, zeros = quantize_int4(w.to(DEVICE), group)
    if fractional:  # Q4_1's -m / d zero points: the fp32 epilogue takes them exactly
        zeros = zeros + torch.rand(zeros.shape, generator=gen).to(DEVICE) - 0.5
    ref = dequantize_int4(qweight, scales, zeros, group, torch.float64)
    return qweight.t().contiguous().t(), scales, zeros, ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("n", "k", "group", "block_n", "block_k"),
    [
        (40, 512, 128, 16, 256),  # K over two tiles
        (33, 576, 128, 8, 512),  # N off the block; a last tile and a last group partial
        (24, 96, 32, 8, 1024),  # groups of 32 (Q4_0/Q4_1); the tile wider than K
        (32, 512, 128, 16, 256),  # even tiles (no masks), K over two
        (16, 256, 128, 16, 256),  # one even tile
    ],
)
@pytest.mark.parametrize("fractional", [False, True])
@pytest.mark.parametrize("dp4a", [False, True])  # the PTX on a GPU (the interpreter: fp32)
def test_matches_the_dequantized_reference(dtype, n, k, group, block_n, block_k, fractional, dp4a):
    qweight, scales, zeros, ref = _layer(n, k, group, fractional)
    assert int4_row_major(qweight)
    x = _x(k, dtype)
    bias = torch.randn(n).to(DEVICE, dtype)
    y = launch_int4_nk(x, qweight, scales, zeros, group, bias, block_n, block_k, 4, dp4a)
    assert y.shape == (1, n) and y.dtype == dtype
    assert _rel_err(y, x, ref, bias) < TOL[dtype]
    y0 = launch_int4_nk(x, qweight, scales, zeros, group, None, block_n, block_k, 4, dp4a)
    assert _rel_err(y0, x, ref) < TOL[dtype]


def _silu_err(y, x, ref, bias=None):
    """Relative error of ``y`` against ``silu(gate) * up`` of the dequantized reference."""
    full = x.double() @ ref.t()
    if bias is not None:
        full = full + bias.double()
    gate, up = full.chunk(2, dim=1)
    expected = torch.nn.functional.silu(gate) * up
    return float((y.double() - expected).norm() / expected.norm())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("n", "k", "block_n", "block_k"),
    [
        (64, 512, 16, 256),  # even tiles, K over two: gate and up 32 rows apart
        (44, 576, 8, 512),  # 22 outputs: the last program's masked; a partial last tile
    ],
)
@pytest.mark.parametrize("dp4a", [False, True])
def test_silu_in_the_epilogue_matches_silu_of_the_reference(dtype, n, k, block_n, block_k, dp4a):
    qweight, scales, zeros, ref = _layer(n, k, fractional=True)
    x = _x(k, dtype)
    bias = torch.randn(n).to(DEVICE, dtype)
    y = launch_int4_nk(x, qweight, scales, zeros, 128, bias, block_n, block_k, 4, dp4a, silu=True)
    assert y.shape == (1, n // 2) and y.dtype == dtype
    assert _silu_err(y, x, ref, bias) < TOL[dtype]
    y0 = launch_int4_nk(x, qweight, scales, zeros, 128, None, block_n, block_k, 4, dp4a, silu=True)
    assert _silu_err(y0, x, ref) < TOL[dtype]
    # not the plain GEMV's first half: the gate rows meet their own up rows
    plain = launch_int4_nk(x, qweight, scales, zeros, 128, None, block_n, block_k, 4, dp4a)
    assert float((y0.double() - plain[:, : n // 2].double()).abs().max()) > 1e-3


def test_the_fused_silu_serves_only_the_tuned_one_row_int4_gemv(monkeypatch):
    from tokenloom.plugins.quant.kernels.gemm_config import GemmConfig
    from tokenloom.plugins.quant.kernels.int4_gemv_nk import int4_nk_fused

    dtype = DTYPES[0]
    qweight, scales, zeros, ref = _layer(64, 512, fractional=True)
    x = _x(512, dtype)
    nk = next(c for c in INT4_NK_DP4A if c.block_n == 16)
    y = int4_nk_fused(x, qweight, scales, zeros, 128, None, nk, silu=True)
    assert y is not None and y.shape == (1, 32) and _silu_err(y, x, ref) < TOL[dtype]
    assert int4_nk_fused(x, qweight, scales, zeros, 128, None, INT4_NK_MMA[0], silu=True) is None
    assert (
        int4_nk_fused(x, qweight, scales, zeros, 128, None, GemmConfig(16, 64, 128), silu=True)
        is None
    )
    assert (
        int4_nk_fused(torch.cat([x, x]), qweight, scales, zeros, 128, None, nk, silu=True) is None
    )
    dense = qweight.contiguous()  # [K / 8, N] storage
    assert int4_nk_fused(x, dense, scales, zeros, 128, None, nk, silu=True) is None
    odd, s_odd, z_odd, _ = _layer(63, 512)  # no two equal halves
    assert int4_nk_fused(x, odd, s_odd, z_odd, 128, None, nk, silu=True) is None
    monkeypatch.setenv("TOKENLOOM_INT4_FUSED_SILU", "0")
    assert int4_nk_fused(x, qweight, scales, zeros, 128, None, nk, silu=True) is None


def test_serves_only_the_calls_it_fits():
    qweight, scales, zeros, _ = _layer(16, 256)
    x = _x(256, DTYPES[0])
    assert int4_nk_fits(x, qweight, 128, True)
    dense = qweight.contiguous()  # [K / 8, N] storage: the other GEMVs' layout
    assert not int4_row_major(dense) and not int4_nk_fits(x, dense, 128, True)
    assert not int4_nk_fits(torch.cat([x, x]), qweight, 128, True)  # one row only
    assert not int4_nk_fits(x, qweight, 16, True)  # groups of a multiple of 32
    assert not int4_nk_fits(x, qweight, 128, False)  # zero points (every int4 format here)
    odd, _, _, _ = _layer(16, 200, 40)  # K / 8 = 25: no whole elements of four words
    assert not int4_nk_fits(_x(200, DTYPES[0]), odd, 40, True)
    with pytest.raises(AssertionError):
        launch_int4_nk(x, dense, scales, zeros, 128, None, 8, 256, 4)


def test_the_tuner_offers_it_at_one_row_for_row_major_words_only():
    one, few = (candidates(i, 4096, 4096, 4, 128, 132, nk=True) for i in (0, 1))
    offered = set(INT4_NK + INT4_NK_MMA + INT4_NK_DP4A)
    assert {c for c in one if c.nk} == offered
    # whole rows over 16 warps where K is long (Llama's down) only
    down = candidates(0, 4096, 14336, 4, 128, 132, nk=True)
    assert {c for c in down if c.nk} == offered | set(INT4_NK_WIDE)
    assert all(c.num_warps == 16 and c.block_k == 16384 for c in INT4_NK_WIDE)
    longer = candidates(0, 4096, 32768, 4, 128, 132, nk=True)  # two tiles: not offered
    assert not set(INT4_NK_WIDE) & set(longer)
    assert not any(c.nk for c in few)
    assert not any(c.gemv or c.h2 for c in one + few)  # they read [K / 8, N] storage
    dense = candidates(0, 4096, 4096, 4, 128, 132)
    assert not any(c.nk for c in dense) and any(c.gemv for c in dense)
    # exact for the fractional zero points of a Q4_1 file (its fp32 epilogue)
    assert set(INT4_NK) <= set(candidates(0, 4096, 4096, 4, 32, 132, True, nk=True))
    assert all(c.fits(4, 32) and not c.fits(4, 16) and not c.fits(4, 0) for c in INT4_NK)


def test_the_engine_stores_int4_row_major_unless_told_and_runs_it(tiny_model_factory, monkeypatch):
    from tokenloom import LLM, SamplingParams

    model_dir = str(tiny_model_factory("llama"))
    # where the engine runs on a GPU, the dtype its one-row PTX serves (bf16 on sm_90+;
    # a float32 model there keeps [K / 8, N], which this test once expected otherwise)
    dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    monkeypatch.setenv("TOKENLOOM_INT4_ROW_MAJOR", "0")
    dense = LLM(model_dir, dtype=dtype, quant="int4")
    layer = dense.engine.executor.model.model.layers[0].mlp.down_proj
    assert layer.qweight.is_contiguous()  # [K / 8, N], the kernels before session 17
    dense.engine.shutdown()
    monkeypatch.delenv("TOKENLOOM_INT4_ROW_MAJOR")
    llm = LLM(model_dir, dtype=dtype, quant="int4")
    layer = llm.engine.executor.model.model.layers[0].mlp.down_proj
    serves = int4_nk_serves(
        layer.scales.dtype, layer.qweight.device, 128, layer.qweight.shape[0] * 8
    )
    assert serves or torch.cuda.get_device_capability()[0] < 9  # CPU and sm_90+: row-major
    assert int4_row_major(layer.qweight) == serves == (not layer.qweight.is_contiguous())
    params = SamplingParams(temperature=0.0, max_tokens=4)
    assert len(llm.generate([[5, 9, 2]], params, use_tqdm=False)[0].outputs[0].token_ids) == 4


def test_row_major_storage_only_where_it_serves_one_row(monkeypatch):
    # the formats int4_gemv_nk takes: groups of a multiple of 32, whole elements of 32 k
    cpu = torch.device("cpu")
    assert int4_nk_serves(torch.float32, cpu, 128, 4096)
    assert not int4_nk_serves(torch.float32, cpu, 16, 4096)
    assert not int4_nk_serves(torch.float32, cpu, 0, 4096)
    assert not int4_nk_serves(torch.float32, cpu, 32, 4096 + 8)
    # on a GPU its PTX: bf16 on sm_90+ (f16 models and older GPUs keep the GEMVs' layout)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cuda = torch.device("cuda", 0)
    for major, dtype, serves in [
        (9, torch.bfloat16, True),
        (9, torch.float16, False),
        (8, torch.bfloat16, False),
        (10, torch.bfloat16, True),
    ]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, m=major: (m, 0))
        assert int4_nk_serves(dtype, cuda, 128, 4096) is serves


def test_an_engine_whose_layers_it_cannot_serve_keeps_the_gemvs_layout(tiny_model_factory):
    from tokenloom import LLM

    model_dir = str(tiny_model_factory("llama"))
    llm = LLM(model_dir, dtype="float32", quant="int4", plugin={"int4": {"group_size": 16}})
    layer = llm.engine.executor.model.model.layers[0].mlp.down_proj
    assert layer.qweight.is_contiguous() and not int4_row_major(layer.qweight)
    llm.engine.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
@pytest.mark.parametrize(
    ("block_n", "block_k", "warps"), [(8, 4096, 4), (16, 2048, 2), (16, 4096, 4), (32, 4096, 4)]
)
@pytest.mark.parametrize(("outlier", "scale"), [(0.0, 1.0), (3e3, 1.0), (0.0, 1e-6), (0.0, 1e4)])
@pytest.mark.parametrize("dp4a", [False, True])
def test_gpu_llama_shapes(n, k, block_n, block_k, warps, outlier, scale, dp4a):
    # the range guard: Llama's massive activations (an outlier of thousands), tiny
    # activations (scaled up, not lost in f16's subnormals) and large ones (no overflow);
    # with dp4a, x's 16-bit fixed point over the same ranges
    qweight, scales, zeros, ref = _layer(n, k)
    x = _x(k, torch.bfloat16, outlier * scale, scale=scale)
    y = launch_int4_nk(x, qweight, scales, zeros, 128, None, block_n, block_k, warps, dp4a)
    assert torch.isfinite(y).all()
    assert _rel_err(y, x, ref) < TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("dp4a", [False, True])
def test_gpu_a_nan_in_x_reaches_the_output(dp4a):
    qweight, scales, zeros, _ = _layer(4096, 4096)
    x = _x(4096, torch.bfloat16)
    x[0, 100] = float("nan")
    y = launch_int4_nk(x, qweight, scales, zeros, 128, None, 16, 4096, 4, dp4a)
    assert torch.isnan(y).all()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize(
    ("block_n", "block_k", "warps"), [(8, 4096, 4), (16, 2048, 2), (16, 4096, 4), (32, 4096, 4)]
)
@pytest.mark.parametrize("dp4a", [False, True])
@pytest.mark.parametrize("n", [28672, 2 * 4779])  # Llama-3-8B; a rank of three: masked
def test_gpu_silu_in_the_epilogue_at_gate_up(block_n, block_k, warps, dp4a, n):
    qweight, scales, zeros, ref = _layer(n, 4096)
    x = _x(4096, torch.bfloat16, 3e3)
    y = launch_int4_nk(
        x, qweight, scales, zeros, 128, None, block_n, block_k, warps, dp4a, silu=True
    )
    assert y.shape == (1, n // 2) and torch.isfinite(y).all()
    assert _silu_err(y, x, ref) < TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize(("block_n", "block_k", "warps"), [(16, 16384, 16), (8, 16384, 16)])
@pytest.mark.parametrize(("outlier", "scale"), [(0.0, 1.0), (3e3, 1.0), (0.0, 1e-6), (0.0, 1e4)])
@pytest.mark.parametrize("dp4a", [False, True])
def test_gpu_whole_rows_over_16_warps_at_down(block_n, block_k, warps, outlier, scale, dp4a):
    qweight, scales, zeros, ref = _layer(4096, 14336)
    x = _x(14336, torch.bfloat16, outlier * scale, scale=scale)
    y = launch_int4_nk(x, qweight, scales, zeros, 128, None, block_n, block_k, warps, dp4a)
    assert torch.isfinite(y).all()
    assert _rel_err(y, x, ref) < TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_gpu_the_int4_kernel_fuses_silu_at_one_row_only(monkeypatch):
    from tokenloom.plugins.quant.int4 import Int4Kernel

    qweight, scales, zeros, ref = _layer(28672, 4096)
    kernel = Int4Kernel(qweight, scales.bfloat16(), zeros.bfloat16(), 128)
    x = _x(4096, torch.bfloat16, 3e3)
    y = kernel.apply_silu_and_mul(x, None)
    cfg = kernel.configs[0]  # the tuner's one-row choice: fused where it is int4_gemv_nk
    if not (cfg.nk and not cfg.mma):
        assert y is None
        return
    assert y is not None and y.shape == (1, 14336)
    assert _silu_err(y, x, ref) < TOL[torch.bfloat16]
    assert kernel.apply_silu_and_mul(torch.cat([x, x]), None) is None  # one row only
    monkeypatch.setenv("TOKENLOOM_INT4_FUSED_SILU", "0")
    assert kernel.apply_silu_and_mul(x, None) is None
