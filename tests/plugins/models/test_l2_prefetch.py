"""The L2 prefetch of the gate/up weights during the one-row decode attention
(``l2_prefetch.py``): which bytes it asks for, that it is off on the CPU, and on the GPU
that it compiles, reaches L2 and changes no token."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tokenloom.plugins.models import l2_prefetch

CUDA = torch.cuda.is_available()


def test_row_regions_take_the_same_rows_of_each_part() -> None:
    rows = torch.arange(16 * 4, dtype=torch.int32).view(16, 4)  # 16 bytes a row, parts of 8
    gate, up = l2_prefetch.row_regions(rows, 2, nbytes=3 * 2 * 16, at=0.25)
    assert gate.tolist() == rows[2:5].flatten().tolist()  # rows 2-4 of the first part
    assert up.tolist() == rows[10:13].flatten().tolist()  # the same rows of the second
    (whole,) = l2_prefetch.row_regions(rows, 1, nbytes=10**6, at=0.5)
    assert whole.data_ptr() == rows[8].data_ptr() and whole.numel() == 8 * 4  # to the end
    assert l2_prefetch.row_regions(rows, 2, nbytes=8, at=0.0) == []  # under one row a part
    assert l2_prefetch.row_regions(rows.t(), 1, nbytes=64, at=0.0) == []  # not row-major


def test_regions_of_an_int4_layer_and_a_16_bit_one() -> None:
    storage = torch.zeros(8, 16, dtype=torch.int32)  # [N, K / 8]: 64 bytes a row
    scales, zeros = torch.ones(2, 8), torch.ones(2, 8)
    kernel = SimpleNamespace(qweight=storage.t(), scales=scales, zeros=zeros)
    layer = SimpleNamespace(output_sizes=[4, 4], kernel=kernel)
    found = l2_prefetch.regions_of(layer, nbytes=256, at=0.5, scales=False)
    assert [t.data_ptr() for t in found] == [storage[2].data_ptr(), storage[6].data_ptr()]
    assert [t.numel() for t in found] == [32, 32]  # two rows of each half
    with_scales = l2_prefetch.regions_of(layer, nbytes=256, at=0.5, scales=True)
    assert len(with_scales) == 4 and with_scales[2].data_ptr() == scales.data_ptr()
    dense = SimpleNamespace(output_sizes=[8], kernel=None, weight=torch.zeros(8, 32))
    (rows,) = l2_prefetch.regions_of(dense, nbytes=3 * 128, at=0.0, scales=True)
    assert rows.numel() == 3 * 32
    other = SimpleNamespace(output_sizes=[8], kernel=SimpleNamespace(qweight=None))
    assert l2_prefetch.regions_of(other, nbytes=256, at=0.0, scales=False) == []


def test_kernel_args_pad_to_four_regions_in_whole_16_bytes() -> None:
    a, dummy = torch.zeros(13, dtype=torch.int16), torch.zeros(1)
    args = l2_prefetch.kernel_args((a,), dummy)
    assert args[0] is a and args[1] == 16  # 26 bytes: the last 10 are not asked for
    assert args[2::2] == [dummy] * 3 and args[3::2] == [0] * 3


def test_off_by_default_and_on_the_cpu(monkeypatch) -> None:
    layer = SimpleNamespace(output_sizes=[8], kernel=None, weight=torch.zeros(8, 32))
    with l2_prefetch.during(layer, 1, torch.device("cpu")):
        assert l2_prefetch.current() == ()
    monkeypatch.setenv("TOKENLOOM_L2_PREFETCH_MB", "1")
    with l2_prefetch.during(layer, 1, torch.device("cpu")):  # no PDL, no sm_90
        assert l2_prefetch.current() == ()
    assert l2_prefetch.current() == ()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_gpu_the_prefetched_bytes_are_read_from_l2() -> None:
    import triton
    import triton.language as tl

    from tokenloom.plugins.models.pdl import pdl_on

    if not pdl_on(torch.device("cuda")):
        pytest.skip("needs sm_90")

    @triton.jit
    def _issue(p0, n0, p1, n1, p2, n2, p3, n3):
        l2_prefetch.prefetch(p0, n0, p1, n1, p2, n2, p3, n3, tl.program_id(0),
                             tl.num_programs(0), 128)  # fmt: skip

    mb = 2**20
    warm, cold = (torch.ones(16 * mb // 4, dtype=torch.int32, device="cuda") for _ in "ab")
    flush = torch.empty(256 * mb, dtype=torch.int8, device="cuda")
    dummy = torch.zeros(4, device="cuda")

    def timed(t: torch.Tensor) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t.sum()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    ratios = []
    for _ in range(5):  # each read from an idle GPU, after the flush (and the prefetch)
        flush.fill_(1)  # L2 holds neither tensor now
        _issue[(32,)](*l2_prefetch.kernel_args((warm,), dummy), num_warps=4)
        torch.cuda.synchronize()
        t_warm = timed(warm)
        flush.fill_(1)
        torch.cuda.synchronize()
        t_cold = timed(cold)
        ratios.append(t_warm / t_cold)
    assert sorted(ratios)[2] < 0.85, ratios  # the median read was faster from L2


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("eager", [True, False])
def test_gpu_an_int4_llama_decodes_the_same_tokens_with_the_prefetch(
    int4_llama_tokens, monkeypatch, eager
):
    from tokenloom.plugins.attention.triton_kernels import decode

    asked: list[int] = []
    original = decode.decode_attention

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        asked.append(len(kwargs.get("l2_regions", ())))
        return original(*args, **kwargs)

    monkeypatch.setattr(decode, "decode_attention", spy)
    from tokenloom.plugins.attention import triton_backend

    monkeypatch.setattr(triton_backend, "decode_attention", spy)
    monkeypatch.setenv("TOKENLOOM_L2_PREFETCH_MB", "1")
    monkeypatch.setenv("TOKENLOOM_L2_PREFETCH_SCALES", "1")
    with_prefetch = int4_llama_tokens(eager, "gate_up_proj")
    assert 4 in asked  # two gate/up row slices, scales and zero points
    monkeypatch.setenv("TOKENLOOM_L2_PREFETCH_MB", "0")
    asked.clear()
    assert int4_llama_tokens(eager, "gate_up_proj") == with_prefetch
    assert asked and not any(asked)
