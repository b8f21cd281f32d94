"""The weight-only Triton GEMM (int8 and int4 weights) and the int4 GEMV equal the
reference path (dequantize, then ``F.linear``): tiny shapes in the interpreter on the
CPU, the real configs and Llama-3-8B shapes on the GPU; the dispatcher offers the GEMV
only where it fits (int8 stored ``[K, N]``, which has none: ``test_int8_gemv_nk.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tokenloom.plugins.quant.int4 import dequantize_int4, quantize_int4
from tokenloom.plugins.quant.int8 import dequantize_int8, quantize_int8
from tokenloom.plugins.quant.kernels.dispatch import BUCKETS, SPLIT_BYTES, bucket, candidates
from tokenloom.plugins.quant.kernels.int4_tiles import _dequant_kmajor, dequant_asm_ok
from tokenloom.plugins.quant.kernels.weight_gemm import GemmConfig, choose_config, weight_gemm

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def _quantized(bits: int | str, n: int, k: int, dtype: torch.dtype, group: int = 128):
    w = torch.randn(n, k, device=DEVICE) / k**0.5
    if bits in (8, "8kn"):  # int8 stored [N, K] (quantize_int8's), or [K, N] ("8kn")
        qweight, scales = quantize_int8(w)
        if bits == "8kn":
            qweight = qweight.contiguous()
        return (qweight, scales, None, 0), dequantize_int8(qweight, scales, torch.float64)
    qweight, scales, zeros = quantize_int4(w.to(dtype), group)
    return (qweight, scales, zeros, group), dequantize_int4(
        qweight, scales, zeros, group, torch.float64
    )


def _check(bits, m, n, k, dtype, config, bias, group=128, tol=None):
    torch.manual_seed(0)
    (qweight, scales, zeros, grp), w = _quantized(bits, n, k, dtype, group)
    x = torch.randn(m, k, device=DEVICE, dtype=dtype)
    b = torch.randn(n, device=DEVICE, dtype=dtype) if bias else None
    got = weight_gemm(x, qweight, scales, zeros, 8 if bits == "8kn" else bits, grp, b, config)
    expected = F.linear(x.double(), w, None if b is None else b.double())
    assert got.shape == (m, n) and got.dtype == dtype
    err = float((got.double() - expected).norm() / expected.norm())
    assert err < (tol or {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype])


# tiny tiles keep the interpreter quick; each case crosses a tile or group edge
SMALL = [
    (GemmConfig(16, 16, 32), 1, 40, 96),  # decode row, N and K not multiples of the tile
    (GemmConfig(16, 16, 64, split_k=2), 5, 32, 256),  # K split; a tile holds 2 groups
    (GemmConfig(16, 32, 16), 20, 48, 64),  # two row tiles; a group spans 2 tiles
]


@pytest.mark.parametrize("bits", [8, "8kn", 4])
@pytest.mark.parametrize(("config", "m", "n", "k"), SMALL)
@pytest.mark.parametrize("bias", [False, True])
def test_weight_gemm_equals_dequantized_linear(bits, config, m, n, k, bias):
    _check(bits, m, n, k, torch.float32, config, bias, group=32)


@pytest.mark.parametrize("block_k", [16, 64])
def test_int4_gather_path_equals_the_reshape_path(block_k):
    # expand=False: words gathered per row and the group of every row (any tiling)
    config = GemmConfig(16, 16, block_k, expand=False)
    _check(4, 3, 24, 192, torch.float32, config, True, group=32)


def test_int4_gemm_with_a_partial_last_group():
    # K = 96 with groups of 64: the second group has 32 rows (SmolLM2's K = 576 case)
    _check(4, 3, 32, 96, torch.float32, GemmConfig(16, 16, 32), False, group=64)


def test_float16_in_the_interpreter():
    _check(4, 2, 32, 64, torch.float16, GemmConfig(16, 16, 32), True, group=32)


GEMV_CASES = [
    (GemmConfig(1, 16, 32, gemv=True), 1, 40, 96),  # N and K not multiples of the tile
    (GemmConfig(1, 16, 32, split_k=2, gemv=True), 3, 32, 256),  # K split, three rows
    (GemmConfig(1, 32, 16, gemv=True), 2, 48, 64),  # two tiles per group
    (GemmConfig(1, 16, 32, gemv=True, rows=2), 3, 40, 96),  # rows per program: a partial pair
    (GemmConfig(1, 16, 32, split_k=2, gemv=True, rows=4), 7, 32, 256),  # 4 + 3 rows, K split
    (GemmConfig(1, 32, 16, gemv=True, rows=4), 1, 48, 64),  # one row takes the 1-row kernel
    # K 200: the last split holds one word of a partial tile, the last group 8 rows
    (GemmConfig(1, 16, 32, split_k=3, gemv=True), 2, 24, 200),
    (GemmConfig(1, 16, 32, split_k=3, gemv=True, rows=4), 5, 24, 200),
]


@pytest.mark.parametrize(("config", "m", "n", "k"), GEMV_CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_weight_gemv_equals_dequantized_linear(config, m, n, k, bias):
    _check(4, m, n, k, torch.float32, config, bias, group=32)


def test_weight_gemv_with_a_partial_last_group_and_float16():
    _check(4, 2, 32, 96, torch.float32, GemmConfig(1, 16, 32, gemv=True), False, group=64)
    _check(4, 1, 32, 64, torch.float16, GemmConfig(1, 16, 32, gemv=True), True, group=32)
    _check(4, 3, 32, 96, torch.float16, GemmConfig(1, 16, 32, gemv=True, rows=2), True, group=64)


KMAJOR_CASES = [
    (GemmConfig(16, 16, 32, kmajor=True), 1, 40, 96),  # N and K not multiples of the tile
    (GemmConfig(16, 16, 32, split_k=2, kmajor=True), 5, 32, 256),  # K split
    (GemmConfig(16, 32, 16, kmajor=True), 20, 48, 64),  # two row tiles; two tiles per group
    (GemmConfig(16, 16, 32, kmajor=True, swap=True), 20, 40, 96),  # out^T = W x^T
    (GemmConfig(16, 32, 16, split_k=2, kmajor=True, swap=True), 3, 48, 256),
]


@pytest.mark.parametrize(("config", "m", "n", "k"), KMAJOR_CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_int4_kmajor_tile_equals_dequantized_linear(config, m, n, k, bias):
    assert config.fits(4, 32) and not config.fits(8, 0)
    _check(4, m, n, k, torch.float32, config, bias, group=32)


def test_int4_kmajor_tile_in_float16_and_where_it_does_not_fit():
    _check(4, 3, 32, 96, torch.float16, GemmConfig(16, 16, 32, kmajor=True), True, group=32)
    # BLOCK_K 64 over groups of 32: not K-major; the kernel takes the gather path
    config = GemmConfig(16, 16, 64, kmajor=True)
    assert not config.fits(4, 32)
    _check(4, 3, 32, 128, torch.float32, config, False, group=32)


@triton.jit
def _dequant_tile_kernel(qw_ptr, s_ptr, z_ptr, x_ptr, out_ptr, N, ASM: tl.constexpr):
    """One ``[16, 32]`` tile of ``_dequant_kmajor`` (rows of N, K from 0) written out."""
    BN: tl.constexpr = 16
    BK: tl.constexpr = 32
    offs_n = tl.arange(0, BN)
    kw = tl.arange(0, BK // 8)
    words = tl.load(qw_ptr + kw[None, :] * N + offs_n[:, None])
    s = tl.load(s_ptr + offs_n).to(tl.float32)[:, None]
    z = tl.load(z_ptr + offs_n).to(tl.float32)[:, None]
    x = tl.load(x_ptr + tl.arange(0, 16)[:, None] * BK + tl.arange(0, BK)[None, :])
    w = _dequant_kmajor(words, s, z, x, ASM)
    tl.store(out_ptr + offs_n[:, None] * BK + tl.arange(0, BK)[None, :], w)


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.float16,
        pytest.param(
            torch.bfloat16, marks=pytest.mark.skipif(not CUDA, reason="interpreter: no bf16")
        ),
    ],
)
def test_the_kmajor_dequantization_is_the_reference_bit_for_bit(dtype):
    """Every nibble position, zero point 0-15 and a spread of scales: the tile equals the
    reference's ``((q - z) s)`` rounded to the dtype exactly (on the GPU with 16-bit
    dtypes, through the PTX path)."""
    torch.manual_seed(0)
    n, k = 16, 32
    q = torch.randint(0, 16, (k, n), device=DEVICE, dtype=torch.int32)
    qweight = torch.zeros(k // 8, n, dtype=torch.int32, device=DEVICE)
    for j in range(8):
        qweight |= q[j::8] << (4 * j)
    # scales from 16-bit subnormals (GPTQ's f16 scales reach 1e-6) to 2e-2
    scales = torch.logspace(-7, -1.7, n, device=DEVICE)[torch.randperm(n, device=DEVICE)]
    scales = scales[None].to(dtype)
    x = torch.zeros(16, k, device=DEVICE, dtype=dtype)
    asm = dequant_asm_ok(x)  # the PTX path where the GPU has it (sm_90 for bf16)
    for zeros in (
        torch.arange(n, device=DEVICE, dtype=torch.float32).remainder(16)[None].to(dtype),
        torch.zeros(1, n, device=DEVICE, dtype=dtype),  # symmetric formats: zero point 0
    ):
        expected = dequantize_int4(qweight, scales, zeros, 32, dtype)
        out = torch.empty(n, k, device=DEVICE, dtype=dtype)
        _dequant_tile_kernel[(1,)](qweight, scales, zeros, x, out, n, ASM=asm)
        assert torch.equal(out, expected)


def test_a_gemv_tiling_that_does_not_fit_the_groups_falls_back_to_the_gemm():
    # BLOCK_K 64 over groups of 96: neither holds the other whole
    config = GemmConfig(1, 16, 64, gemv=True)
    assert config.fits(4, 32) and not config.fits(4, 96)
    _check(4, 1, 32, 192, torch.float32, config, False, group=96)


@pytest.mark.parametrize("m", [1, 20])
def test_the_default_tiling_of_groups_that_do_not_nest_with_it(m):
    # no tiling given: choose_config's 256-deep skinny tile (or 64-deep square one) holds no
    # whole number of groups of 96 nor lies in one, so the dot tile gathers; at 256 x 4
    # stages that took 704 KB of shared memory in fp32 on an H100 (session 43), so a
    # gathering fallback is 64 deep and 3 stages at most
    _check(4, m, 32, 384, torch.float32, None, True, group=96)


@pytest.mark.parametrize("rows", [3, 8])
def test_a_gemv_row_count_the_kernel_lacks_is_neither_offered_nor_run(rows):
    # the rows kernel spells out 2 or 4 rows: any other count left rows unwritten
    # (garbage from torch.empty) while fits() admitted it
    config = GemmConfig(1, 16, 32, gemv=True, rows=rows)
    assert not config.fits(4, 32)
    _check(8, rows, 16, 64, torch.float32, config, True)
    _check(4, rows, 16, 64, torch.float32, config, False, group=32)


def test_the_kmajor_tiles_are_offered_to_int4_in_every_bucket_up_to_256_rows_only():
    for index in range(4):
        int4 = candidates(index, 4096, 14336, 4, 128, 132)
        assert any(c.kmajor and c.swap for c in int4)
        assert not any(c.kmajor for c in candidates(index, 4096, 14336, 8, 0, 132))
        for c in int4:  # the split's partial sums stay bounded at the bucket's rows
            rows = max(BUCKETS[index][1])
            assert c.split_k * rows * 4096 * 4 <= SPLIT_BYTES
    assert not any(c.swap for c in candidates(4, 4096, 14336, 4, 128, 132) if c.block_m < 64)


def test_the_dispatcher_offers_the_gemv_where_it_fits():
    assert [bucket(m) for m in (1, 2, 16, 17, 64, 65, 256, 257)] == [0, 1, 1, 2, 2, 3, 3, 4]
    int4 = candidates(0, 4096, 4096, 4, 128, 132)
    gemv = [c for c in int4 if c.gemv]
    assert any(128 % c.block_k == 0 for c in gemv)  # the tile in one group
    assert all(128 % c.block_k == 0 or c.block_k % 128 == 0 for c in gemv)
    assert any(not c.gemv for c in int4)  # the dot kernel competes
    down = candidates(0, 4096, 14336, 4, 128, 132)
    assert any(c.gemv and c.split_k > 1 for c in down)  # 4096 columns: split K too
    assert not any(c.gemv for c in candidates(2, 4096, 4096, 4, 128, 132))


def test_decode_batches_split_k_on_narrow_layers():
    h200_sms = 132
    down = choose_config(1, 4096, 14336, h200_sms)  # 64 column tiles: too few alone
    assert down.block_m == 16 and down.split_k >= 4
    assert choose_config(1, 28672, 4096, h200_sms).split_k <= 2  # wide: enough tiles
    assert choose_config(256, 4096, 4096, h200_sms).split_k == 1


LLAMA_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate_up, down


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("bits", [8, "8kn", 4])
@pytest.mark.parametrize("m", [1, 7, 16, 48, 300])
@pytest.mark.parametrize(("n", "k"), LLAMA_8B)
def test_weight_gemm_on_llama_shapes_gpu(bits, m, n, k):
    _check(bits, m, n, k, torch.bfloat16, None, m == 7)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 16, 100, 300])
@pytest.mark.parametrize(("n", "k"), LLAMA_8B)
def test_int4_kmajor_on_llama_shapes_gpu(dtype, m, n, k):
    for config in (
        GemmConfig(64, 64, 128, 1, 4, 3, kmajor=True),
        GemmConfig(128, 128, 64, 1, 8, 3, kmajor=True),
        GemmConfig(16, 128, 128, 2, 4, 3, kmajor=True, swap=True),
        GemmConfig(64, 128, 64, 1, 4, 3, kmajor=True, swap=True),
    ):
        _check(4, m, n, k, dtype, config, m == 100)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("bits", [8, "8kn", 4])  # 8: int8_gemv_nk; "8kn": a dot tile
@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("split_k", [1, 4])
@pytest.mark.parametrize(("n", "k"), LLAMA_8B)
def test_weight_gemv_on_llama_shapes_gpu(bits, m, split_k, n, k):
    config = GemmConfig(1, 64, 128, split_k, 4, 3, gemv=True)
    _check(bits, m, n, k, torch.bfloat16, config, m == 4)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize(("m", "rows"), [(3, 2), (16, 4), (7, 4)])
@pytest.mark.parametrize(("n", "k"), LLAMA_8B)
def test_weight_gemv_rows_on_llama_shapes_gpu(m, rows, n, k):
    config = GemmConfig(1, 64, 128, 4, 4, 3, gemv=True, rows=rows)
    _check(4, m, n, k, torch.bfloat16, config, m == 7)


@pytest.mark.parametrize(
    "config",
    [
        GemmConfig(16, 16, 32),  # the tile lies in one group
        GemmConfig(16, 16, 64),  # two whole groups per tile
        GemmConfig(1, 16, 32, gemv=True),
    ],
)
def test_int4_without_zero_points(config):
    # zeros=None means zero points of 0 (symmetric formats): every int4 path subtracts
    # the float constant its nibble conversion adds, and nothing else
    torch.manual_seed(0)
    (qweight, scales, zeros, group), _ = _quantized(4, 32, 128, torch.float32, group=32)
    x = torch.randn(3, 128, device=DEVICE)
    expected = F.linear(
        x.double(),
        dequantize_int4(qweight, scales, torch.zeros_like(zeros), group, torch.float64),
    )
    got = weight_gemm(x, qweight, scales, None, 4, group, None, config)
    assert float((got.double() - expected).norm() / expected.norm()) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_biased_int4_nibbles_stay_within_a_tiny_fraction_of_the_exact_gemv(dtype):
    # _nibble_biased accumulates (A_j + q) x with A_j up to 2^15 and takes sum A_j x off
    # once per word row: the fp32 partial sums (split K, no 16-bit rounding) stay within
    # 1e-4 of the exact path, also with an activation outlier of 300 in a 16-bit row
    from tokenloom.plugins.quant.kernels.weight_gemv import launch_gemv

    torch.manual_seed(1)
    n, k, m, group = 32, 512, 2, 128
    (qweight, scales, zeros, grp), w = _quantized(4, n, k, torch.float32, group)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    x[1, 77] = 300.0
    expected = F.linear(x.double(), w)
    cfg = GemmConfig(1, 16, 64, 2, gemv=True)
    errs = {}
    for biased in (False, True):
        y = torch.zeros(2, m, n, device=DEVICE)
        launch_gemv(x, qweight, scales, zeros, 4, grp, None, y, m, n, k, k // 2, 2, cfg, biased)
        got = y.sum(0).double()
        errs[biased] = float((got - expected).norm() / expected.norm())
    assert errs[False] < 1e-6
    assert errs[True] < 1e-4


def test_the_one_row_gemv_sums_its_splits_in_the_kernel_and_leaves_the_counters_zero(
    monkeypatch,
):
    # the last split of each tile adds the others' partials (no split-sum launch); a
    # second call reuses the counters, which every launch leaves at zero
    from tokenloom.plugins.quant.kernels import gemm_tile
    from tokenloom.plugins.quant.kernels.weight_gemv import reduce_counters

    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("the split-sum kernel ran")

    monkeypatch.setattr(gemm_tile, "_split_sum_kernel", NoLaunch())
    torch.manual_seed(0)
    (qweight, scales, zeros, group), w = _quantized(4, 40, 256, torch.float32, 32)
    x = torch.randn(2, 256, device=DEVICE)
    b = torch.randn(40, device=DEVICE)
    expected = F.linear(x.double(), w, b.double())
    for _ in range(2):
        got = weight_gemm(
            x, qweight, scales, zeros, 4, group, b, GemmConfig(1, 16, 32, 3, gemv=True)
        )
        assert float((got.double() - expected).norm() / expected.norm()) < 1e-5
    assert int(reduce_counters(x.device, 1).abs().sum()) == 0


def test_the_in_kernel_split_sum_adds_in_split_order_bit_for_bit_as_the_split_sum_kernel(
    monkeypatch,
):
    # the last split to arrive sums the partials in split order, not its own first: the
    # result does not depend on which split finished last, and equals the second launch's
    from tokenloom.plugins.quant.kernels import weight_gemm as module

    torch.manual_seed(3)
    (qweight, scales, zeros, group), _ = _quantized(4, 24, 512, torch.float32, 32)
    x = torch.randn(1, 512, device=DEVICE) * 1e3
    cfg = GemmConfig(1, 8, 32, 4, gemv=True)
    fused = weight_gemm(x, qweight, scales, zeros, 4, group, None, cfg)
    monkeypatch.setattr(module, "reduce_counters", lambda device, needed: None)
    launched = weight_gemm(x, qweight, scales, zeros, 4, group, None, cfg)
    assert torch.equal(fused, launched)


@pytest.mark.gpu
def test_gpu_cold_tuning_keeps_its_choices_apart_and_correct(monkeypatch, tmp_path):
    """``TOKENLOOM_TUNE_COLD=1`` times the candidates over copies of the weights (read
    from HBM, not L2): the choices are stored under their own key and every bucket's
    tiling still agrees with the dequantized reference."""
    from tokenloom.plugins.quant.kernels import dispatch

    monkeypatch.setenv("TOKENLOOM_CACHE", str(tmp_path))
    monkeypatch.setenv("TOKENLOOM_TUNE_COLD", "1")
    monkeypatch.setattr(dispatch, "_DECIDED", {})
    w = torch.randn(4096, 4096, device="cuda") / 64  # o's shape: 8 MB in int4, cached hot
    qw, s, z = quantize_int4(w.to(torch.bfloat16), 128)
    qw = qw.t().contiguous().t()  # [N, K / 8], as the engine stores it on sm_90
    ref = dequantize_int4(qw, s, z, 128, torch.bfloat16)
    configs = dispatch.choose_configs(qw, s, z, 4, 128, torch.bfloat16, lambda x: F.linear(x, ref))
    assert len(configs) == len(BUCKETS) and all(" cold" in key for key in dispatch._DECIDED)
    for config, (_, rows) in zip(configs, BUCKETS, strict=True):
        x = torch.randn(rows[-1], 4096, device="cuda", dtype=torch.bfloat16)
        y = weight_gemm(x, qw, s, z, 4, 128, None, config).float()
        expected = F.linear(x.float(), ref.float())
        assert float((y - expected).norm() / expected.norm()) < 2e-2, config
