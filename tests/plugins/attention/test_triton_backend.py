"""The Triton backend against a dense float64 attention and the torch backend.

Without a GPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py sets it)
on tiny shapes, in fp32 and fp16 only (bf16 ``tl.dot`` is wrong under the
interpreter). Relative error ||out - ref|| / ||ref|| bounds: fp32 1e-5 (ieee dots),
fp16 3e-3, bf16 2e-2 (probabilities are rounded to the input dtype before P @ V).
"""

from __future__ import annotations

import pytest
import torch
from paged_batches import dense_reference, make_batch, model_info, relative_error

from tokenloom.config import EngineConfig
from tokenloom.plugins.attention import triton_backend
from tokenloom.plugins.attention.torch_backend import TorchAttention
from tokenloom.plugins.attention.triton_backend import TritonAttention
from tokenloom.plugins.attention.triton_settings import cuda_defaults
from tokenloom.plugins.models.pdl import pdl_on

TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# on a GPU these are GPU tests (the kernels run there), so `pytest -m gpu` selects them
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []


def backends(num_heads, num_kv_heads, head_dim, dtype, device=DEVICE, **settings):
    info = model_info(num_heads, num_kv_heads, head_dim, dtype, device)
    return TritonAttention(EngineConfig(), info, **settings), TorchAttention(EngineConfig(), info)


def forward(backend, batch):
    return backend.forward(
        batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta, batch.scale
    )


def check_against_references(query_lens, seq_lens, *, num_heads=4, num_kv_heads=2,
                             head_dim=32, dtype=torch.float32, device=DEVICE, prepare=True,
                             **settings):  # fmt: skip
    batch = make_batch(
        query_lens, seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, dtype=dtype, device=device,
    )  # fmt: skip
    triton_attn, torch_attn = backends(num_heads, num_kv_heads, head_dim, dtype, device, **settings)
    k_ref, v_ref = batch.clone_caches()
    if prepare:
        triton_attn.prepare(batch.meta)
    out = forward(triton_attn, batch)
    assert out.shape == batch.q.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    assert relative_error(out, dense_reference(batch)) < TOLERANCE[dtype]
    reference = torch_attn.forward(batch.q, batch.k, batch.v, k_ref, v_ref, batch.meta, batch.scale)
    assert torch.equal(batch.k_cache, k_ref) and torch.equal(batch.v_cache, v_ref)
    assert relative_error(out, reference.double().cpu()) < 2 * TOLERANCE[dtype]


# --------------------------------------------------------------------------- decode


def decode_outputs(batch, kv_dtype, settings_list):
    """The decode output of ``batch`` (8 heads on 2, head size 32, fp16, four splits)
    over a 16-bit cache or a copy quantized to ``kv_dtype``, once per backend settings."""
    from test_kv_quant import quantized_copy

    from tokenloom.plugins.attention.torch_backend import write_kv_cache

    caches = (batch.k_cache, batch.v_cache)
    if kv_dtype is not None:
        caches = quantized_copy(batch, kv_dtype)
        write_kv_cache(batch.k, batch.v, *caches, batch.meta.slot_mapping)
    outs = []
    for settings in settings_list:
        attn, _ = backends(8, 2, 32, torch.float16, max_num_splits=4, **settings)
        attn.prepare(batch.meta)
        outs.append(attn.forward(batch.q, batch.k, batch.v, *caches, batch.meta, batch.scale,
                                 kv_written=kv_dtype is not None))  # fmt: skip
    return outs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_decode_matches_references_for_gqa_groups_1_2_4(num_kv_heads, dtype):
    check_against_references([1] * 5, [1, 16, 17, 70, 33], num_kv_heads=num_kv_heads, dtype=dtype)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_matches_references_for_large_head_dims(head_dim):
    check_against_references([1, 1], [23, 48], head_dim=head_dim, dtype=torch.float16)


def test_head_dim_that_is_not_a_power_of_two_is_masked_correctly():
    check_against_references([1, 1], [23, 40], head_dim=48)
    check_against_references([9, 1], [30, 5], head_dim=48)


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn, torch.int8])
def test_decode_grid_in_either_order_gives_the_same_output(kv_dtype):
    """``decode_heads_first`` only reorders the programs: the same bits come out,
    over a 16-bit or a quantized cache, with the splits merged."""
    batch = make_batch([1, 1, 1, 1], [150, 17, 1, 64], num_heads=8, num_kv_heads=2,
                       head_dim=32, dtype=torch.float16, device=DEVICE)  # fmt: skip
    outs = decode_outputs(batch, kv_dtype, [dict(decode_heads_first=f) for f in (0, 1)])
    assert torch.equal(outs[0], outs[1])
    bound = TOLERANCE[torch.float16] if kv_dtype is None else 0.1
    assert relative_error(outs[1], dense_reference(batch)) < bound


def test_decode_of_one_long_request_merges_four_splits():
    triton_attn, _ = backends(4, 2, 32, torch.float32, max_num_splits=4)
    assert triton_attn.num_splits(1) == 4
    check_against_references([1], [150], max_num_splits=4)


def test_the_last_split_merges_and_leaves_the_counters_zero_for_the_next_launch():
    # Splits merge in the kernel: the last program to finish (counted atomically)
    # merges. Repeated launches on the same scratch must give the same output, so
    # each launch must leave its counters at zero.
    batch = make_batch([1, 1, 1], [150, 37, 3], device=DEVICE)
    triton_attn, _ = backends(4, 2, 32, torch.float32, max_num_splits=4)
    first = forward(triton_attn, batch)
    assert relative_error(first, dense_reference(batch)) < TOLERANCE[torch.float32]
    _, _, counters = triton_attn.scratch.get(3)
    assert int(counters.abs().sum()) == 0
    assert torch.equal(forward(triton_attn, batch), first)


@pytest.mark.parametrize("min_split", [16, 40, 64, 1000])
def test_a_minimum_split_length_keeps_short_kv_in_fewer_programs(min_split):
    # 150 tokens over 4 splits of 16-token tiles: 48 per split by default; a minimum
    # split (rounded up to whole tiles) leaves fewer programs active (one at 1000:
    # no merge at all), and every count must give the same attention.
    check_against_references(
        [1, 1, 1], [150, 37, 3], max_num_splits=4, decode_min_split_tokens=min_split
    )


def test_kv_within_the_minimum_split_skips_the_partials():
    batch = make_batch([1, 1, 1], [150, 37, 3], device=DEVICE)
    triton_attn, _ = backends(4, 2, 32, torch.float32, max_num_splits=4)
    triton_attn.resolved.decode_min_split_tokens = 160  # 150 tokens in one program
    part_out, part_lse, _ = triton_attn.scratch.get(3)
    part_out.fill_(7.0)
    part_lse.fill_(7.0)
    out = forward(triton_attn, batch)
    assert relative_error(out, dense_reference(batch)) < TOLERANCE[torch.float32]
    assert bool((part_out == 7.0).all()) and bool((part_lse == 7.0).all())
    triton_attn.resolved.decode_min_split_tokens = 0  # 48 tokens per split: partials written
    forward(triton_attn, batch)
    assert not bool((part_lse == 7.0).all())


def test_decode_with_one_split_matches_references():
    check_against_references([1, 1, 1], [5, 40, 64], max_num_splits=1)


def test_decode_padding_rows_write_nothing_and_give_zeros():
    batch = make_batch([1, 1], [9, 24], padding_rows=3, device=DEVICE)
    triton_attn, _ = backends(4, 2, 32, torch.float32)
    k_before, v_before = batch.clone_caches()
    out = forward(triton_attn, batch)
    written = torch.zeros(k_before.shape[0] * k_before.shape[1], dtype=torch.bool)
    written[batch.meta.slot_mapping[:2].cpu()] = True
    for cache, before in ((batch.k_cache, k_before), (batch.v_cache, v_before)):
        assert torch.equal(cache.flatten(0, 1)[~written], before.flatten(0, 1)[~written])
    assert torch.all(out[2:] == 0)
    assert relative_error(out[:2], dense_reference(batch)) < TOLERANCE[torch.float32]


def test_decode_reads_strided_query_key_value_views():
    batch = make_batch([1, 1, 1], [3, 19, 40], device=DEVICE)
    fused = torch.cat([batch.q.flatten(1), batch.k.flatten(1), batch.v.flatten(1)], dim=1)
    q, k, v = fused.split([4 * 32, 2 * 32, 2 * 32], dim=1)
    q, k, v = q.view(3, 4, 32), k.view(3, 2, 32), v.view(3, 2, 32)
    assert not q.is_contiguous()
    triton_attn, _ = backends(4, 2, 32, torch.float32)
    out = triton_attn.forward(q, k, v, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert relative_error(out, dense_reference(batch)) < TOLERANCE[torch.float32]


def test_split_count_is_a_power_of_two_that_shrinks_as_the_batch_grows():
    triton_attn, _ = backends(8, 2, 32, torch.float32, max_num_splits=16)
    counts = [triton_attn.num_splits(b) for b in (1, 2, 3, 8, 64, 512)]
    assert all(c & (c - 1) == 0 and 1 <= c <= 16 for c in counts)
    assert counts == sorted(counts, reverse=True)
    assert counts[-1] == 1


# --------------------------------------------------------------------------- prefill


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_without_cached_prefix_matches_references(dtype):
    check_against_references([5, 33, 1], [5, 33, 1], dtype=dtype)


@pytest.mark.parametrize("num_kv_heads", [4, 1])
def test_chunked_prefill_over_cached_prefix_matches_references(num_kv_heads):
    check_against_references([7, 20, 40], [40, 36, 57], num_kv_heads=num_kv_heads)


@pytest.mark.parametrize("prepare", [True, False])
def test_mixed_batch_of_decodes_and_prefills_matches_references(prepare):
    # With prepare, the two leading decodes go to the decode kernel; without, all rows
    # go through the prefill kernel.
    lens = ([1, 1, 9, 1, 18, 1], [30, 70, 9, 3, 50, 17])
    check_against_references(*lens, dtype=torch.float16, prepare=prepare)


def test_prepare_counts_leading_decodes_of_a_mixed_batch():
    batch = make_batch([1, 1, 9, 1], [30, 70, 9, 3], device=DEVICE)
    triton_attn, _ = backends(4, 2, 32, torch.float32)
    triton_attn.prepare(batch.meta)
    assert batch.meta.extra["num_leading_decodes"] == 2


def test_prefill_with_head_dim_64_matches_references():
    check_against_references([19, 2], [19, 35], head_dim=64, dtype=torch.float16)


# --------------------------------------------------------------------------- registration


def test_plugin_registers_triton_attention_component():
    (spec,) = triton_backend.tokenloom_register_components()
    assert (spec.kind, spec.name, spec.factory) == ("attention", "triton", TritonAttention)


def test_unknown_plugin_setting_is_refused():
    with pytest.raises(ValueError, match="block_q"):
        backends(4, 2, 32, torch.float32, block_q=8)


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("min_split", [0, 1000])
def test_the_first_tile_read_before_the_wait_gives_the_same_bits(kv_dtype, min_split, monkeypatch):
    """``decode_prefetch_max_batch``: each program's first tile is read before the PDL
    wait without the new token, which is read after it (the last position of each
    request: in a first tile at 1, 5, 16 and 17 tokens, in a later one at 150). The same
    bits come out as the loop alone, with and without the splits' merge, over a 16-bit
    or a quantized cache, and a padding row stays zero."""
    # the kernel serves 8-bit caches too, though the backend offers it 16-bit ones only
    monkeypatch.setattr(TritonAttention, "_prefetch",
                        lambda self, n, quantized, rope: n <= self.resolved.decode_prefetch_max_batch)  # fmt: skip
    batch = make_batch([1] * 5, [150, 17, 1, 16, 5], num_heads=8, num_kv_heads=2,
                       head_dim=32, dtype=torch.float16, padding_rows=1, device=DEVICE)  # fmt: skip
    settings = [
        dict(decode_min_split_tokens=min_split, decode_prefetch_max_batch=b) for b in (0, 6)
    ]
    outs = decode_outputs(batch, kv_dtype, settings)
    assert torch.equal(outs[0], outs[1])
    assert torch.all(outs[1][5:] == 0)
    bound = TOLERANCE[torch.float16] if kv_dtype is None else 0.1
    assert relative_error(outs[1][:5], dense_reference(batch)[:5]) < bound


def test_the_prefetch_reaches_the_kernel_only_up_to_its_batch_and_without_rope(monkeypatch):
    seen = []
    real = triton_backend.decode_attention
    monkeypatch.setattr(triton_backend, "decode_attention",
                        lambda *a, **kw: seen.append(kw["prefetch"]) or real(*a, **kw))  # fmt: skip
    for batch_size, expected in ((2, True), (3, False)):
        batch = make_batch([1] * batch_size, [9] * batch_size, device=DEVICE)
        attn, _ = backends(4, 2, 32, torch.float32, decode_prefetch_max_batch=2)
        out = forward(attn, batch)
        assert seen[-1] is expected
        assert relative_error(out, dense_reference(batch)) < TOLERANCE[torch.float32]


def test_the_backend_prefetches_over_16_bit_caches_without_rope_up_to_its_batch():
    attn, _ = backends(4, 2, 32, torch.float32, decode_prefetch_max_batch=4)
    assert attn._prefetch(4, False, None)
    assert not attn._prefetch(5, False, None)
    assert not attn._prefetch(4, True, None)  # an 8-bit tile spills under QUANT_DECODE's cap
    assert not attn._prefetch(4, False, object())  # rope in the kernel writes the new token
    default = backends(4, 2, 32, torch.float32)[0].resolved.decode_prefetch_max_batch
    if triton_backend.is_interpreted():  # the interpreter overlaps nothing
        assert default == 0
    else:  # on CUDA the measured default where PDL overlaps the kernels, else 0
        on = pdl_on(torch.device(DEVICE))
        assert default == (cuda_defaults(32)["decode_prefetch_max_batch"] if on else 0)


def test_the_first_tile_before_the_wait_with_a_padded_head_dim():
    # head_dim 48 pads to 64 in the kernel: the new token's padded dims must read 0
    check_against_references([1, 1], [23, 5], head_dim=48, decode_prefetch_max_batch=2)


def test_an_fp8_cache_prefills_with_its_own_tiles(monkeypatch):
    # FP8_PREFILL's tiles (where measured: CUDA) reach the kernel for an fp8 cache only;
    # 16-bit and int8 caches keep the prefill settings
    from test_kv_quant import quantized_copy

    seen = []
    real = triton_backend.prefill_attention
    monkeypatch.setattr(triton_backend, "prefill_attention",
                        lambda *a, **kw: seen.append(kw) or real(*a, **kw))  # fmt: skip
    batch = make_batch([5, 3], [9, 3], device=DEVICE)
    attn, _ = backends(4, 2, 32, torch.float32)
    plain = attn.resolved.prefill_tiles[False]
    attn.resolved.prefill_tiles[True] = dict(plain, prefill_block_m=2 * plain["prefill_block_m"])
    forward(attn, batch)
    assert seen[-1]["block_m"] == plain["prefill_block_m"]
    for kv_dtype, block_m in ((torch.int8, plain["prefill_block_m"]),
                              (torch.float8_e4m3fn, 2 * plain["prefill_block_m"])):  # fmt: skip
        k_cache, v_cache = quantized_copy(batch, kv_dtype)
        out = attn.forward(batch.q, batch.k, batch.v, k_cache, v_cache, batch.meta, batch.scale)
        assert seen[-1]["block_m"] == block_m
        assert relative_error(out, dense_reference(batch)) < 8e-2  # the 8-bit rounding


def test_the_prefill_tiles_follow_the_measured_fp8_defaults_and_the_settings():
    from tokenloom.plugins.attention.triton_settings import FP8_PREFILL, prefill_tiles

    def tiles(settings, measured=True):
        return prefill_tiles(settings, {**cuda_defaults(128), **settings}, measured)

    plain = {key: cuda_defaults(128)[key] for key in FP8_PREFILL}
    assert dict(plain, prefill_num_stages=2) == FP8_PREFILL  # what session 37 measured
    assert tiles({}) == {False: plain, True: FP8_PREFILL}
    assert tiles({}, measured=False) == {False: plain, True: plain}
    # a tile key set: both caches take the settings as given
    chosen = tiles({"prefill_num_warps": 8})
    assert chosen[True] == chosen[False] == dict(plain, prefill_num_warps=8)
    # the product dtype is not a tile key: the fp8 tiles stay
    assert tiles({"prefill_kv_f16": 0})[True] == FP8_PREFILL


def test_the_fp8_mma_decode_tiles_follow_the_measured_defaults_and_the_settings():
    from tokenloom.plugins.attention.triton_settings import MMA_DECODE, mma_decode_tiles

    def tiles(settings, measured=True, interpreted=False):
        defaults = {**cuda_defaults(128), **settings}
        return mma_decode_tiles(settings, defaults, measured, interpreted)

    ours = (64, 3, 128, True)
    assert tuple(MMA_DECODE.values()) == ours  # what session 37 measured on the H200
    assert tiles({}) == ours
    # not measured there (head_dim > 128, fp32 queries): the plain settings
    assert tiles({}, measured=False) == (0, 2, 0, False)
    assert tiles({}, measured=False, interpreted=True) == (0, 1, 0, False)
    # any of its tile keys set: the settings as given, nothing of MMA_DECODE
    assert tiles({"decode_num_stages": 5}) == (0, 5, 0, False)
    assert tiles({"decode_maxnreg": 96}) == (0, 2, 96, False)
    assert tiles({"decode_block_n": 128}) == (0, 2, 0, False)
    # the block numbers ahead alone keep the tiles
    assert tiles({"decode_fp8_meta_ahead": 0}) == (64, 3, 128, False)
    assert tiles({"decode_fp8_meta_ahead": 1}, measured=False) == (0, 2, 0, True)
