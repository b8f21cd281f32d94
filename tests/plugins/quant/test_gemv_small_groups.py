"""The int4 GEMVs (one row, and two or four rows per program) serve groups smaller than
their ``BLOCK_K`` (llama.cpp's Q4_0 / Q4_1 groups of 32): each word row of eight
weights takes its own group's scale and zero point, also fractional ones, with K split
or not and K no multiple of the tile; groups that hold whole tiles (128) are the
control. Tiny shapes in the interpreter on the CPU; the measured dispatch on the GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenloom.plugins.quant.int4 import Int4Kernel, dequantize_int4
from tokenloom.plugins.quant.int4_pack import pack_int4
from tokenloom.plugins.quant.kernels.dispatch import BUCKETS, bucket, candidates
from tokenloom.plugins.quant.kernels.weight_gemm import GemmConfig, weight_gemm
from tokenloom.plugins.quant.kernels.weight_gemv import gemv_fits

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def _int4(n: int, k: int, group: int, dtype: torch.dtype, device: str = DEVICE):
    """Random int4 weights with fractional zero points in [-2, 17] (Q4_1's ``-min / d``
    is any float), and their reference dequantization in float64."""
    groups = -(-k // group)
    q = torch.randint(0, 16, (k, n), device=device)
    scales = (torch.rand(groups, n, device=device) * 0.04 + 0.01).to(dtype)
    zeros = (torch.rand(groups, n, device=device) * 19 - 2).to(dtype)
    qweight = pack_int4(q)
    return qweight, scales, zeros, dequantize_int4(qweight, scales, zeros, group, torch.float64)


# (group, BLOCK_K): groups of 32 and 64 inside the tile; 128 over 64-wide tiles (one
# scale row per tile, the measured path) and over 256-wide ones (two groups per tile)
NESTINGS = [(32, 64), (32, 128), (64, 128), (128, 64), (128, 256)]
ROWS = [(1, 1), (2, 2), (4, 5)]  # (rows per program, rows of x): 4 + 1 leaves a partial block


@pytest.mark.parametrize(("group", "block_k"), NESTINGS)
@pytest.mark.parametrize(("rows", "m"), ROWS)
@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_gemv_equals_the_dequantized_linear_for_groups_of_any_nesting(
    group, block_k, rows, m, split_k, dtype
):
    # K = 224: no multiple of 64 or 128 (the last tile is partial; groups of 64 and 128
    # end with a partial group), and each split starts on a tile, so on a group
    torch.manual_seed(group + block_k + rows + split_k)
    n, k = 40, 224
    qweight, scales, zeros, w = _int4(n, k, group, dtype)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    b = torch.randn(n, device=DEVICE).to(dtype)
    config = GemmConfig(1, 16, block_k, split_k, gemv=True, rows=rows)
    assert config.fits(4, group)
    got = weight_gemm(x, qweight, scales, zeros, 4, group, b, config)
    expected = F.linear(x.double(), w, b.double())
    err = float((got.double() - expected).norm() / expected.norm())
    assert got.dtype == dtype and err < {torch.float32: 1e-6, torch.float16: 1e-3}[dtype]


@pytest.mark.parametrize("rows", [1, 4])
def test_small_groups_without_zero_points(rows):
    torch.manual_seed(0)
    qweight, scales, zeros, _ = _int4(24, 128, 32, torch.float32)
    w = dequantize_int4(qweight, scales, torch.zeros_like(zeros), 32, torch.float64)
    x = torch.randn(rows, 128, device=DEVICE)
    config = GemmConfig(1, 16, 64, 2, gemv=True, rows=rows)
    got = weight_gemm(x, qweight, scales, None, 4, 32, None, config)
    expected = F.linear(x.double(), w)
    assert float((got.double() - expected).norm() / expected.norm()) < 1e-6


def test_the_gemv_fits_groups_of_whole_words_that_nest_with_the_tile():
    assert gemv_fits(4, 32, 64, True) and gemv_fits(4, 32, 256, True, rows=4)
    assert gemv_fits(4, 128, 64, True) and gemv_fits(4, 128, 256, True)
    assert not gemv_fits(4, 96, 64, True)  # neither nests in the other
    assert not gemv_fits(4, 4, 64, True)  # a word's eight rows would span two groups


@pytest.mark.parametrize("index", range(len(BUCKETS)))
def test_every_bucket_offers_a_tiling_for_groups_of_32(index):
    offered = candidates(index, 4096, 4096, 4, 32, 132)
    assert offered
    if index <= 1:  # decode: the GEMV competes
        assert any(c.gemv for c in offered)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 14336)])
def test_groups_of_32_through_the_measured_dispatch_gpu(n, k):
    # the tuner measures every candidate (the GEMV's PTX paths included) and keeps the
    # fastest that agrees; each bucket's choice then equals the fp32 reference in bf16
    torch.manual_seed(0)
    qweight, scales, zeros, _ = _int4(n, k, 32, torch.bfloat16, "cuda")
    kernel = Int4Kernel(qweight, scales, zeros, 32)
    assert kernel.configs is not None
    for m in (1, 3, 16, 100, 1024):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        got = kernel.apply(x, bias).float()
        ref = kernel.reference(x.float(), bias.float())
        err = float((got - ref).norm() / ref.norm())
        assert err < 1e-2, (m, kernel.configs[bucket(m)], err)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 14336)])
def test_every_gemv_candidate_for_groups_of_32_equals_the_reference_gpu(n, k):
    # the tuner skips a candidate that fails silently: here each must compile and agree
    torch.manual_seed(0)
    qweight, scales, zeros, w = _int4(n, k, 32, torch.bfloat16, "cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for index, m in ((0, 1), (1, 3), (1, 16)):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x.double(), w)
        for config in (c for c in candidates(index, n, k, 4, 32, sms) if c.gemv):
            got = weight_gemm(x, qweight, scales, zeros, 4, 32, None, config).double()
            err = float((got - ref).norm() / ref.norm())
            assert err < 1e-2, (m, config, err)


@pytest.mark.parametrize("group", [32, 128])
def test_fractional_zero_points_are_offered_only_exact_tilings(group):
    # the expanded, K-major and dequantization tiles round z to an integer (2^23 trick):
    # for a Q4_1 file's fractional zeros every bucket keeps exact candidates only
    from tokenloom.plugins.quant.kernels.dispatch import (
        BUCKETS,
        candidates,
        exact_for_fractional_zeros,
    )

    for index in range(len(BUCKETS)):
        everything = candidates(index, 6144, 4096, 4, group, 132)
        exact = candidates(index, 6144, 4096, 4, group, 132, fractional=True)
        assert exact and all(exact_for_fractional_zeros(c) for c in exact)
        assert set(exact) < set(everything)
