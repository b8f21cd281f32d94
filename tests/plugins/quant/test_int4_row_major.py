"""int4 weights stored row-major per output channel (``qweight = packed.t().contiguous().t()``:
the logical ``[K / 8, N]``, strides ``(1, K / 8)``, as int8 is stored ``[N, K]``): the
non-GEMV kernels read them through their strides and give what contiguous storage gives,
and the dequantized reference, on every path: ``weight_gemm``'s EXPAND tiles (in one
group, over several), its gather path, the K-major tile (and ``swap``), split K, and the
whole-weight dequantization; a GEMV or h2 tiling given for this storage gives way to a
dot tile that fits the groups. Every case also reads the same memory as if it were
contiguous (what a kernel ignoring the strides did) and sees a wrong answer, so the test
sees the layout. Tiny shapes in the interpreter; Llama-3-8B shapes on the GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenloom.plugins.quant.int4 import dequantize_int4, quantize_int4
from tokenloom.plugins.quant.kernels import dequant, gemm_tile
from tokenloom.plugins.quant.kernels import weight_gemm as weight_gemm_module
from tokenloom.plugins.quant.kernels.int4_tiles import int4_row_major
from tokenloom.plugins.quant.kernels.weight_gemm import GemmConfig, weight_gemm

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# against the float64 reference: the output's rounding (the interpreter's fp32 is exact)
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 4e-3}
DEQUANT = GemmConfig(0, 0, 0, dequant=True)
SPIED = ("EXPAND", "KMAJOR", "SWAP", "PARTIAL", "BLOCK_K", "GROUP")


def _row_major(qweight):
    """The same logical ``[K / 8, N]``, each output channel's words contiguous."""
    return qweight.t().contiguous().t()


def _misread(qweight):
    """Row-major memory taken for contiguous ``[K / 8, N]``: what a kernel that ignores
    the strides reads."""
    return qweight.t().view(qweight.shape)


def _layer(n, k, group, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) / k**0.5
    qweight, scales, zeros = quantize_int4(w.to(DEVICE, dtype), group)
    return qweight, scales, zeros


def _rel(y, expected):
    return float((y.double() - expected).norm() / expected.norm())


@pytest.fixture
def spy(monkeypatch):
    """What reached the kernels: the dot kernel's paths (``SPIED`` and the strides it was
    given), and ``"gemv"`` for each launch of a GEMV over ``[K / 8, N]``."""
    calls: list = []
    real = gemm_tile._weight_gemm_kernel
    qk = real.arg_names.index("stride_qk")  # stride_qk, stride_qn: passed by position

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                calls.append({**{key: kwargs[key] for key in SPIED}, "strides": args[qk : qk + 2]})
                return real[grid](*args, **kwargs)

            return launch

    def gemv(real_launch):
        def launch(*args, **kwargs):
            calls.append("gemv")
            return real_launch(*args, **kwargs)

        return launch

    monkeypatch.setattr(gemm_tile, "_weight_gemm_kernel", Spy())
    for name in ("launch_gemv", "launch_h2"):
        monkeypatch.setattr(weight_gemm_module, name, gemv(getattr(weight_gemm_module, name)))
    return calls


def _compare(config, m, n, k, group, dtype, bias, has_zeros, spy, tol=None):
    """Row-major storage against contiguous storage (bit for bit, the one kernel on the
    one tile; within ``tol`` where they ran different kernels) and the reference; the
    row-major memory misread is wrong. Returns the calls each storage made."""
    qweight, scales, zeros = _layer(n, k, group, dtype)
    if not has_zeros:  # symmetric formats: zero points of 0
        zeros = torch.zeros_like(zeros)
    ref = dequantize_int4(qweight, scales, zeros, group, torch.float64)
    zeros = zeros if has_zeros else None
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if bias else None
    expected = F.linear(x.double(), ref, None if b is None else b.double())
    rm = _row_major(qweight)
    assert rm.stride() == (1, k // 8) and int4_row_major(rm) and not int4_row_major(qweight)
    y_c = weight_gemm(x, qweight, scales, zeros, 4, group, b, config)
    calls_c = spy[:]
    spy.clear()
    y_r = weight_gemm(x, rm, scales, zeros, 4, group, b, config)
    calls_r = spy[:]
    assert y_r.shape == (m, n) and y_r.dtype == dtype
    assert _rel(y_r, expected) < TOL[dtype]
    if tol is None:
        assert torch.equal(y_r, y_c)
    else:
        assert _rel(y_r, y_c.double()) < tol
    misread = weight_gemm(x, _misread(rm), scales, zeros, 4, group, b, config)
    assert _rel(misread, expected) > 0.3  # the layout matters to these shapes
    return calls_c, calls_r


# (config, m, n, k, group, the path it takes); N and K off the tile, a partial last group
PATHS = [
    (GemmConfig(16, 16, 32), 3, 40, 200, 64, "expand, the tile in one group"),
    (GemmConfig(16, 16, 64), 20, 40, 200, 32, "expand, two groups a tile"),
    (GemmConfig(16, 16, 32, expand=False), 3, 24, 200, 32, "gather"),
    (GemmConfig(16, 16, 32), 3, 24, 200, 48, "gather"),  # groups of 48, tiles of 32
    (GemmConfig(16, 16, 32, kmajor=True), 3, 40, 200, 64, "kmajor"),
    (GemmConfig(16, 32, 16, kmajor=True, swap=True), 20, 40, 200, 32, "kmajor, swap"),
    (GemmConfig(16, 16, 32, split_k=3), 5, 40, 200, 64, "expand, the tile in one group"),
    (GemmConfig(16, 16, 64, split_k=2), 5, 40, 256, 32, "expand, two groups a tile"),
    (GemmConfig(16, 16, 32, split_k=2, kmajor=True, swap=True), 5, 40, 200, 32, "kmajor, swap"),
    (DEQUANT, 3, 40, 200, 64, "dequant"),
]
VARIANTS = [  # (dtype, bias, zero points)
    (torch.float32, False, True),
    (torch.float16, True, True),
    (torch.float32, True, False),
]


def _path(call) -> str:
    if call["KMAJOR"]:
        return "kmajor, swap" if call["SWAP"] else "kmajor"
    if not call["EXPAND"]:
        return "gather"
    if call["BLOCK_K"] <= call["GROUP"]:
        return "expand, the tile in one group"
    return "expand, two groups a tile"


@pytest.mark.parametrize(("config", "m", "n", "k", "group", "path"), PATHS)
@pytest.mark.parametrize(("dtype", "bias", "has_zeros"), VARIANTS)
def test_row_major_storage_equals_contiguous_storage_on_every_path(
    config, m, n, k, group, path, dtype, bias, has_zeros, spy
):
    calls_c, calls_r = _compare(config, m, n, k, group, dtype, bias, has_zeros, spy)
    if path == "dequant":  # the whole weight dequantized, then F.linear: no dot kernel
        assert calls_c == calls_r == []
        return
    assert len(calls_r) == 1 and _path(calls_r[0]) == path
    assert calls_r[0]["PARTIAL"] == (config.split_k > 1)
    assert calls_c[0]["strides"] == (n, 1) and calls_r[0]["strides"] == (1, k // 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("n", "k", "group"), [(72, 320, 64), (40, 96, 64), (40, 200, 128)])
def test_the_whole_weight_dequantization_reads_row_major_storage(dtype, n, k, group):
    qweight, scales, zeros = _layer(n, k, group, dtype)
    rm = _row_major(qweight)
    for z in (zeros, None):
        expected = dequantize_int4(
            qweight, scales, zeros if z is not None else torch.zeros_like(zeros), group, dtype
        )
        # a view of the scratch buffer: cloned before the next call writes it
        got = dequant.dequantize_into(rm, scales, z, 4, group, dtype).clone()
        assert torch.equal(got, expected)
        assert torch.equal(dequant.dequantize_into(qweight, scales, z, 4, group, dtype), expected)
        misread = dequant.dequantize_into(_misread(rm), scales, z, 4, group, dtype)
        assert (misread != expected).float().mean() > 0.5


# GEMV and h2 tilings over [K / 8, N]: groups smaller than the fallback's tile (32), K no
# multiple of the group (96 over 64), one to sixteen rows
REROUTED = [
    (GemmConfig(1, 16, 32, gemv=True), 1, 40, 96, 64),
    (GemmConfig(1, 16, 32, gemv=True), 1, 40, 200, 32),
    (GemmConfig(1, 16, 32, gemv=True, rows=2), 3, 40, 96, 32),
    (GemmConfig(1, 16, 32, split_k=2, gemv=True, rows=4), 16, 24, 256, 32),
    (GemmConfig(1, 16, 32, h2=True), 1, 40, 96, 32),
    (GemmConfig(1, 16, 32, split_k=2, h2=True), 1, 40, 200, 64),
]


@pytest.mark.parametrize(("config", "m", "n", "k", "group"), REROUTED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_gemv_or_h2_tiling_gives_way_to_a_dot_tile_that_fits_the_groups(
    config, m, n, k, group, dtype, spy
):
    if CUDA and config.h2:  # h2 runs bf16 on the GPU: test_gpu_llama_shapes
        pytest.skip("h2 takes fp32 and fp16 in the interpreter only")
    # against the GEMV's output: its fp32 sums, or h2's f16 chains (~5e-4 of |y|)
    tol = 2e-3 if config.h2 or dtype == torch.float16 else 1e-5
    calls_c, calls_r = _compare(config, m, n, k, group, dtype, m == 3, True, spy, tol)
    assert calls_c == ["gemv"]  # contiguous storage: the GEMV it was given ran
    # row-major: a dot tile whose gather path serves any group (and any zero point)
    assert len(calls_r) == 1 and not calls_r[0]["EXPAND"] and not calls_r[0]["KMAJOR"]
    assert calls_r[0]["strides"] == (1, k // 8)


@pytest.mark.parametrize(
    "config", [GemmConfig(1, 16, 32, gemv=True), GemmConfig(1, 8, 64, nk=True)]
)
def test_a_rerouted_call_keeps_zero_points_that_are_no_integers(config, spy):
    # a GGUF Q4_1 file's zero points (-m / d): the EXPAND tiles fold z into the 2^23
    # conversion constant, which rounds it (5.8e-2 of |y| wrong); a rerouted call takes
    # the gather path, exact for any z. Two rows: int4_gemv_nk (one row) gives way too.
    n, k, group = 40, 256, 64
    qweight, scales, zeros = _layer(n, k, group, torch.float32)
    zeros = zeros + torch.linspace(-3.3, 2.7, zeros.numel()).view(zeros.shape).to(zeros)
    ref = dequantize_int4(qweight, scales, zeros, group, torch.float64)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    y = weight_gemm(x, _row_major(qweight), scales, zeros, 4, group, None, config)
    assert _rel(y, x.double() @ ref.t()) < TOL[torch.float32]
    assert len(spy) == 1 and not spy[0]["EXPAND"]
    rounded = dequantize_int4(qweight, scales, zeros.round(), group, torch.float64)
    assert _rel(x.double() @ rounded.t(), x.double() @ ref.t()) > 1e-2  # z matters here


def test_without_a_config_decode_batches_take_a_dot_tile_too(spy):
    _compare(None, 1, 40, 96, 64, torch.float32, False, True, spy)
    assert len(spy) == 2 and all(call["EXPAND"] for call in spy)  # no reroute: choose_config's


def test_int4_row_major_and_its_degenerate_shapes():
    q = torch.arange(24, dtype=torch.int32).view(4, 6)  # K / 8 = 4, N = 6
    assert not int4_row_major(q) and int4_row_major(_row_major(q))
    assert not int4_row_major(q.to(torch.int8)) and not int4_row_major(q.float())
    # strided views neither layout: refused by both, and by weight_gemm
    for view in (q[:, ::2], _row_major(q)[::2], q[:, :1]):
        assert not int4_row_major(view) and not view.is_contiguous()
    with pytest.raises(AssertionError, match="contiguous"):
        weight_gemm(torch.randn(1, 32), q[:, ::2], torch.ones(1, 3), None, 4, 32)
    # one output channel, or K = 8 (one word per channel): the two storages are the same
    # memory, and both count as row-major (the memory is [N, K / 8])
    for one in (q[:, :1].contiguous(), q[:1].contiguous()):
        assert one.is_contiguous() and _row_major(one).is_contiguous()
        assert int4_row_major(one) and int4_row_major(_row_major(one))


@pytest.mark.parametrize(("n", "k"), [(1, 96), (24, 8)])
def test_one_channel_or_one_word_per_channel(n, k, spy):
    # the degenerate shapes run the dot tile whatever their strides (int4_row_major is
    # True): a GEMV tiling gives way, and the result is the reference's
    qweight, scales, zeros = _layer(n, k, 32, torch.float32)
    ref = dequantize_int4(qweight, scales, zeros, 32, torch.float64)
    x = torch.randn(2, k, device=DEVICE)
    config = GemmConfig(1, 16, 32, gemv=True)
    for storage in (qweight, _row_major(qweight)):
        y = weight_gemm(x, storage, scales, zeros, 4, 32, None, config)
        assert _rel(y, x.double() @ ref.t()) < 1e-5
    assert len(spy) == 2 and "gemv" not in spy


LLAMA_8B = [(6144, 4096), (4096, 14336)]  # qkv, down
GPU_CONFIGS = [
    None,  # choose_config
    GemmConfig(1, 64, 128, 4, 4, 3, gemv=True),  # rerouted
    GemmConfig(1, 64, 128, 2, 2, 3, h2=True),  # rerouted
    GemmConfig(16, 64, 256, 4, 4, 4),  # EXPAND, two groups a tile, split K
    GemmConfig(64, 64, 128, 1, 4, 3),  # EXPAND, the tile in one group
    GemmConfig(64, 64, 64, 1, 4, 3, expand=False),  # gather
    GemmConfig(64, 64, 128, 1, 4, 3, kmajor=True),
    GemmConfig(16, 128, 128, 2, 4, 3, kmajor=True, swap=True),
    DEQUANT,
]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize(("n", "k"), LLAMA_8B)
@pytest.mark.parametrize("cfg", GPU_CONFIGS)
@pytest.mark.parametrize("m", [1, 16, 128])
def test_gpu_llama_shapes(n, k, cfg, m):
    qweight, scales, zeros = _layer(n, k, 128, torch.bfloat16)
    ref = dequantize_int4(qweight, scales, zeros, 128, torch.float64)
    rm = _row_major(qweight)
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    expected = x.double() @ ref.t()
    y = weight_gemm(x, rm, scales, zeros, 4, 128, None, cfg)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    assert _rel(y, expected) < TOL[torch.bfloat16]
    y_c = weight_gemm(x, qweight, scales, zeros, 4, 128, None, cfg)
    assert _rel(y, y_c.double()) < 2 * TOL[torch.bfloat16]
    assert _rel(weight_gemm(x, _misread(rm), scales, zeros, 4, 128, None, cfg), expected) > 0.3
