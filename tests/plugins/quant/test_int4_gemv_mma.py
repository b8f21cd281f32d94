"""The one-row int4 GEMV on the tensor cores (``int4_gemv_mma``) equals the dequantized
reference: its indexing, masks and group epilogue in fp32 in the interpreter on the CPU;
on the GPU its ``mma.sync`` fragments (the diagonal of each lane quad) at the Llama-3-8B
shapes, for every tiling the tuner offers, with outliers, tiny and large activations,
zero points that are no integers, and partial tiles; it serves groups of 128 only."""

from __future__ import annotations

import pytest
import torch
from test_int4_gemv_h2 import _rel_err, _x
from test_int4_gemv_nk import _layer

from tokenloom.plugins.quant.kernels.dispatch import INT4_NK_MMA, candidates
from tokenloom.plugins.quant.kernels.int4_gemv_mma import int4_mma_fits, launch_int4_mma
from tokenloom.plugins.quant.kernels.weight_gemm import weight_gemm

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.bfloat16] if CUDA else [torch.float32, torch.float16]
# GPU: exact products, fp32 sums (the MMA's), bf16 output rounding (~2e-3 of |y|)
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 4e-3}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("n", "k", "block_n", "block_k"),
    [
        (40, 512, 16, 256),  # K over two tiles
        (33, 640, 8, 512),  # N off the block; a last tile partial
        (24, 256, 16, 1024),  # the tile wider than K
    ],
)
@pytest.mark.parametrize("fractional", [False, True])
def test_matches_the_dequantized_reference(dtype, n, k, block_n, block_k, fractional):
    qweight, scales, zeros, ref = _layer(n, k, 128, fractional)
    x = _x(k, dtype)
    bias = torch.randn(n).to(DEVICE, dtype)
    y = launch_int4_mma(x, qweight, scales, zeros, 128, bias, block_n, block_k, 4)
    assert y.shape == (1, n) and y.dtype == dtype
    assert _rel_err(y, x, ref, bias) < TOL[dtype]
    y0 = launch_int4_mma(x, qweight, scales, zeros, 128, None, block_n, block_k, 4)
    assert _rel_err(y0, x, ref) < TOL[dtype]


def test_serves_groups_of_128_only_and_the_tuner_offers_it_there():
    qweight, scales, zeros, _ = _layer(16, 256, 32)
    x = _x(256, DTYPES[0])
    assert not int4_mma_fits(x, qweight, 32, True) and not int4_mma_fits(x, qweight, 64, True)
    with pytest.raises(AssertionError):
        launch_int4_mma(x, qweight, scales, zeros, 32, None, 16, 1024, 1)
    assert all(c.fits(4, 128) and c.fits(4, 256) and not c.fits(4, 32) for c in INT4_NK_MMA)
    assert not any(c.mma for c in candidates(0, 4096, 4096, 4, 32, 132, nk=True))
    offered = candidates(0, 4096, 4096, 4, 128, 132, True, nk=True)  # fractional zeros too
    assert set(INT4_NK_MMA) <= set(offered)


@pytest.mark.parametrize("cfg", INT4_NK_MMA[:2])
def test_weight_gemm_runs_it_for_its_tilings(cfg):
    qweight, scales, zeros, ref = _layer(24, 512, 128, True)
    x = _x(512, DTYPES[0])
    y = weight_gemm(x, qweight, scales, zeros, 4, 128, None, cfg)
    assert _rel_err(y, x, ref) < TOL[DTYPES[0]]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
@pytest.mark.parametrize("cfg", INT4_NK_MMA)
@pytest.mark.parametrize(("outlier", "scale"), [(0.0, 1.0), (3e3, 1.0), (0.0, 1e-6), (0.0, 1e4)])
def test_gpu_llama_shapes(n, k, cfg, outlier, scale):
    qweight, scales, zeros, ref = _layer(n, k)
    x = _x(k, torch.bfloat16, outlier * scale, scale=scale)
    y = weight_gemm(x, qweight, scales, zeros, 4, 128, None, cfg)
    assert torch.isfinite(y).all()
    assert _rel_err(y, x, ref) < TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("cfg", INT4_NK_MMA)
@pytest.mark.parametrize(("n", "k"), [(1000, 1152), (37, 384), (4099, 2944)])
def test_gpu_partial_tiles_fractional_zeros_and_bias(n, k, cfg):
    qweight, scales, zeros, ref = _layer(n, k, 128, True, seed=3)
    x = _x(k, torch.bfloat16, 50.0)
    bias = torch.randn(n).to(DEVICE, torch.bfloat16)
    y = weight_gemm(x, qweight, scales, zeros, 4, 128, bias, cfg)
    assert _rel_err(y, x, ref, bias) < TOL[torch.bfloat16]
