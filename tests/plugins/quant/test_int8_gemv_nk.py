"""The int8 GEMV over weights stored ``[N, K]`` (``int8_gemv_nk``), the layout
``quantize_int8`` gives since session 16: it equals the dequantized reference at one to
sixteen rows (K and N off the tile, bias, fp32 / fp16 / bf16 activations); its 16-bit x
read as int64 words gives the same bits as four strided loads; calls it cannot serve fall
back to the dot tiles, which read the same storage through its strides; the tuner offers
it, and not the GEMVs over ``[K, N]``, for this layout. int8 stored ``[K, N]`` (not the
engine's) has no GEMV since kernels v14: any GEMV or h2 tiling gives way to a dot tile."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tokenloom.plugins.quant.int8 import dequantize_int8, quantize_int8
from tokenloom.plugins.quant.kernels import weight_gemm as weight_gemm_module
from tokenloom.plugins.quant.kernels.dispatch import (
    BUCKETS,
    NK,
    NK_ROWS,
    candidates,
    h2_candidates,
)
from tokenloom.plugins.quant.kernels.int8_gemv_nk import nk_fits, row_major
from tokenloom.plugins.quant.kernels.weight_gemm import GemmConfig, weight_gemm
from tokenloom.plugins.quant.kernels.weight_gemv import gemv_fits

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# the interpreter truncates fp32 to bf16 (the GPU rounds): twice the output's rounding
TOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _layer(n, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    qweight, scales = quantize_int8((torch.randn(n, k, generator=gen) * 0.02).to(DEVICE))
    return qweight, scales, dequantize_int8(qweight, scales, torch.float64)


@pytest.fixture
def launches(monkeypatch):
    """The row counts per program of the calls that reach ``launch_int8_nk``."""
    calls = []
    real = weight_gemm_module.launch_int8_nk

    def spy(*args, **kwargs):
        calls.append(args[7])  # rows of x per program
        return real(*args, **kwargs)

    monkeypatch.setattr(weight_gemm_module, "launch_int8_nk", spy)
    return calls


def test_quantize_int8_stores_each_channel_s_weights_contiguously():
    qweight, scales = quantize_int8(torch.randn(6, 8))
    assert qweight.shape == (8, 6) and row_major(qweight)
    assert qweight.t().is_contiguous() and not row_major(qweight.contiguous())
    assert scales.shape == (1, 6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("m", "rows"), [(1, 1), (3, 2), (5, 4), (1, 4), (16, 4)])
@pytest.mark.parametrize(("n", "k", "block_n", "block_k"), [(40, 96, 16, 64), (33, 200, 8, 128)])
def test_matches_the_dequantized_reference(dtype, m, rows, n, k, block_n, block_k, launches):
    qweight, scales, ref = _layer(n, k)
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(m, k, generator=gen) * 3).to(DEVICE, dtype)
    bias = torch.randn(n, generator=gen).to(DEVICE, dtype)
    cfg = GemmConfig(1, block_n, block_k, 1, 4, 3, nk=True, rows=rows)
    y = weight_gemm(x, qweight, scales, None, 8, 0, bias, cfg)
    assert launches == [rows]  # this kernel ran, not a fallback
    expected = x.double() @ ref.t() + bias.double()
    assert y.shape == (m, n) and y.dtype == dtype
    assert float((y.double() - expected).norm() / expected.norm()) < TOL[dtype]


@pytest.mark.parametrize("rows", [1, 4])
def test_biased_weights_lose_little_whatever_the_mean_of_x(rows, launches):
    # 2^15 + 128 + q, the bias off per word: ~1e-4 of the output, with a mean of 50
    # over K and one outlier of 2,000 (a bias off once, at the end, would cancel
    # 2^15 x 50 x K against the result); the exact conversion stays at fp32 rounding
    qweight, scales, ref = _layer(33, 1024)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 1024, generator=gen) * 3 + 50.0
    x[0, 5] = 2000.0
    x = x.to(DEVICE)
    expected = x.double() @ ref.t()
    errs = []
    for biased in (True, False):
        cfg = GemmConfig(1, 8, 64, 1, 4, 3, nk=True, rows=rows, biased=biased)
        y = weight_gemm(x, qweight, scales, None, 8, 0, None, cfg)
        errs.append(float((y.double() - expected).norm() / expected.norm()))
    assert launches == [rows, rows]
    assert 1e-6 < errs[0] < 3e-4 and errs[1] < 1e-6, errs


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_x_read_as_int64_words_gives_the_strided_loads_bits(dtype, launches):
    # x's rows at an offset of one element cannot be read as int64: four strided loads
    qweight, scales, _ = _layer(24, 64)
    x = (torch.randn(3, 65) * 5).to(DEVICE, dtype)
    aligned = x[:, :64].contiguous()
    shifted = x[:, 1:]  # the same values' copy below at a 2-byte offset
    shifted.copy_(aligned)
    assert shifted.data_ptr() % 8 and aligned.data_ptr() % 8 == 0
    cfg = GemmConfig(1, 8, 64, 1, 4, 3, nk=True, rows=2)
    y_words = weight_gemm(aligned, qweight, scales, None, 8, 0, None, cfg)
    y_loads = weight_gemm(shifted, qweight, scales, None, 8, 0, None, cfg)
    assert launches == [2, 2] and torch.equal(y_words, y_loads)


def test_calls_it_cannot_serve_fall_back_to_the_strided_dot_tiles(launches):
    # one output channel whose rows are no whole words apart (any stride passes row_major)
    odd = torch.empty_strided((8, 1), (1, 3), dtype=torch.int8, device=DEVICE).fill_(3)
    x1 = torch.randn(1, 8, device=DEVICE)
    assert row_major(odd) and not nk_fits(x1, odd)
    y1 = weight_gemm(x1, odd, torch.ones(1, 1, device=DEVICE), None, 8, 0, None, None)
    assert launches == [] and torch.allclose(y1, 3 * x1.sum(1, keepdim=True), rtol=1e-5)
    qweight, scales, ref = _layer(32, 98)  # K = 98: rows of no whole int32 words
    x = torch.randn(2, 98, device=DEVICE)
    assert not nk_fits(x, qweight)
    y = weight_gemm(x, qweight, scales, None, 8, 0, None, GemmConfig(1, 8, 64, nk=True))
    assert launches == []
    expected = x.double() @ ref.t()
    assert float((y.double() - expected).norm() / expected.norm()) < 1e-5
    # the GEMVs over [K, N] storage are rerouted too: they would read [N, K] as [K, N]
    qweight, scales, ref = _layer(32, 128)
    x = torch.randn(1, 128, device=DEVICE)
    y = weight_gemm(x, qweight, scales, None, 8, 0, None, GemmConfig(1, 16, 32, gemv=True))
    assert launches == [1]
    assert float((y.double() - x.double() @ ref.t()).norm() / (x.double() @ ref.t()).norm()) < 1e-5


def test_the_tuner_offers_it_for_the_n_k_layout_only():
    for index in (0, 1):
        nk = candidates(index, 4096, 4096, 8, 0, 132, nk=True)
        assert any(c.nk for c in nk) and not any(c.gemv or c.h2 for c in nk)
        assert all(c.split_k == 1 for c in nk if c.nk)
        assert not any(c.nk for c in candidates(index, 4096, 4096, 8, 0, 132))
    assert {c for c in candidates(0, 4096, 4096, 8, 0, 132, nk=True) if c.nk} == set(NK)
    assert {c for c in candidates(1, 4096, 4096, 8, 0, 132, nk=True) if c.nk} == set(NK + NK_ROWS)
    # x's load takes the FMAs' layout only where a tile row is 256 K per warp (offline sm_90)
    assert all(c.block_k == 256 * c.num_warps for c in NK + NK_ROWS)
    # the biased conversion measured faster on every Llama-3-8B layer (session 17)
    assert all(c.biased and c.fits(8, 0) for c in NK + NK_ROWS)


@pytest.fixture
def kernels(monkeypatch):
    """The kernels ``weight_gemm`` launches: ``"gemv"`` (``launch_gemv`` or
    ``launch_h2``), ``"nk"`` (``launch_int8_nk``) or ``"dot"`` (``launch_gemm``)."""
    calls = []

    def spy(kind, real):
        def launch(*args, **kwargs):
            calls.append(kind)
            return real(*args, **kwargs)

        return launch

    for name, kind in [
        ("launch_gemv", "gemv"),
        ("launch_h2", "gemv"),
        ("launch_int8_nk", "nk"),
        ("launch_gemm", "dot"),
    ]:
        monkeypatch.setattr(weight_gemm_module, name, spy(kind, getattr(weight_gemm_module, name)))
    return calls


@pytest.mark.parametrize(
    ("config", "m"),
    [
        (GemmConfig(1, 16, 32, gemv=True), 1),
        (GemmConfig(1, 16, 32, split_k=2, gemv=True), 3),
        (GemmConfig(1, 16, 32, gemv=True, rows=2), 3),
        (GemmConfig(1, 16, 32, split_k=2, gemv=True, rows=4), 5),
        (GemmConfig(1, 16, 32, h2=True), 1),
        (GemmConfig(1, 16, 32, split_k=2, h2=True), 1),
        (None, 1),
        (None, 4),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_int8_stored_k_n_takes_a_dot_tile_for_any_gemv_tiling(config, m, dtype, kernels):
    # the int8 GEMVs over [K, N] are gone: a GEMV or h2 tiling (or none) gives way to
    # choose_config's dot tile, which reads the storage and equals the reference
    qweight, scales, ref = _layer(40, 96)
    qweight = qweight.contiguous()  # [K, N]
    assert not row_major(qweight) and (config is None or not config.fits(8, 0))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(m, 96, generator=gen).to(DEVICE, dtype)
    bias = torch.randn(40, generator=gen).to(DEVICE, dtype)
    y = weight_gemm(x, qweight, scales, None, 8, 0, bias, config)
    assert kernels == ["dot"]
    expected = x.double() @ ref.t() + bias.double()
    assert y.shape == (m, 40) and y.dtype == dtype
    assert float((y.double() - expected).norm() / expected.norm()) < TOL[dtype]


def test_int8_has_no_gemv_over_k_n():
    assert not gemv_fits(8, 0, 128, False) and gemv_fits(4, 0, 128, False)
    for rows in (1, 2, 4):
        assert not GemmConfig(1, 64, 128, gemv=True, rows=rows).fits(8, 0)
    assert not GemmConfig(1, 64, 128, h2=True).fits(8, 0)
    for index in range(len(BUCKETS)):  # [K, N] storage: the dot tiles (and dequant) only
        int8 = candidates(index, 4096, 14336, 8, 0, 132)
        assert int8 and not any(c.gemv or c.h2 or c.nk for c in int8)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert h2_candidates(4096, 4096, 8, 0, False, dtype) == []


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
@pytest.mark.parametrize("cfg", NK + NK_ROWS + [replace(c, biased=False) for c in NK])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_gpu_llama_shapes(n, k, cfg, m, launches):
    qweight, scales, ref = _layer(n, k)
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    y = weight_gemm(x, qweight, scales, None, 8, 0, None, cfg)
    assert launches == [cfg.rows]
    expected = x.double() @ ref.t()
    assert float((y.double() - expected).norm() / expected.norm()) < 4e-3
