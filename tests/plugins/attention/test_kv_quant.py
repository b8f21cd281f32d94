"""Quantized KV cache (fp8 / int8, per-token-head scales): the pool layout, the
reference quantize/dequantize, the torch backend's reference path, and the Triton
kernels (KV write, decode, prefill) against it.

Without a GPU the kernels run under TRITON_INTERPRET=1 on tiny shapes in fp32 and
fp16. Bounds: the Triton and torch backends read the same quantized cache, so they
agree to the attention tolerance of the query dtype; against the float keys and
values the quantization error is about 1/254 of each row's range for int8 and 2^-4
relative for fp8 e4m3 (3 mantissa bits), which after softmax and averaging over
values measured below 1% (int8) and 4% (fp8) relative on random data.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from paged_batches import dense_reference, make_batch, model_info, relative_error

from tokenloom.config import EngineConfig
from tokenloom.plugins.attention import kv_quant
from tokenloom.plugins.attention.torch_backend import TorchAttention, gather_kv, write_kv_cache
from tokenloom.plugins.attention.triton_backend import TritonAttention
from tokenloom.plugins.attention.triton_kernels import decode_fp8_mma
from tokenloom.plugins.attention.triton_kernels.kv_write import write_kv
from tokenloom.plugins.models import rope_ops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# on a GPU these are GPU tests (the kernels run there), so `pytest -m gpu` selects them
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []
KV_DTYPES = [torch.int8, torch.float8_e4m3fn]
# Output of attention over a quantized cache vs the float keys/values (random data).
QUANT_ERROR = {torch.int8: 1e-2, torch.float8_e4m3fn: 4e-2}
# Triton vs torch over the same quantized cache.
AGREEMENT = {torch.float32: 1e-5, torch.float16: 3e-3}
# The fp8 decode with fp8 products (decode_fp8_mma) rounds q and p * v_scale to e4m3
# (3 mantissa bits): 3.7-4.1% relative on these random shapes (sharp softmax), with the
# interpreter's e4m3 conversions done as the GPU does them (tests/interpreter_e4m3.py).
# A wrong layout or scale is off by ~100%.
FP8_MMA_AGREEMENT = 8e-2


def quantized_copy(batch, dtype, v_transposed=False):
    """Quantized caches holding the batch's (random) float caches, slot for slot."""
    num_blocks, block_size, heads, dim = batch.k_cache.shape
    _, [(k_cache, v_cache)] = kv_quant.allocate(
        1, num_blocks, block_size, heads, dim, dtype, torch.device(DEVICE), v_transposed
    )
    slots = torch.arange(num_blocks * block_size, device=DEVICE)
    write_kv_cache(
        batch.k_cache.flatten(0, 1), batch.v_cache.flatten(0, 1), k_cache, v_cache, slots
    )
    return k_cache, v_cache


# --------------------------------------------------------------------------- reference


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_quantize_error_is_bounded_by_the_format_per_token_head(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 32, generator=gen) * torch.logspace(-3, 3, 64)[:, None, None]
    data, scales = kv_quant.quantize(x, dtype)
    assert data.dtype == dtype and scales.shape == (64, 4)
    back = kv_quant.dequantize(data, scales, torch.float32)
    absmax = x.abs().amax(-1, keepdim=True)
    err = (back - x).abs()
    if dtype == torch.int8:
        assert torch.all(err <= absmax / 254 * 1.001)
        assert data.abs().amax() == 127
    else:  # 3 mantissa bits: half an ulp is 2^-4 relative; tiny values are subnormal
        assert torch.all(err <= x.abs() / 16 + absmax / 448 * 2**-9)
    assert torch.all(back.abs().amax(-1, keepdim=True) <= absmax * 1.001)


def test_zero_rows_get_a_zero_scale_and_dequantize_to_zero():
    data, scales = kv_quant.quantize(torch.zeros(3, 2, 8), torch.int8)
    assert torch.all(scales == 0) and torch.all(data == 0)


def test_quantized_pool_views_are_disjoint_and_blocks_are_16_byte_aligned():
    pool, caches = kv_quant.allocate(2, 5, 4, 3, 8, torch.int8, torch.device("cpu"))
    per_block = kv_quant.block_bytes(4, 3, 8, torch.int8)
    assert per_block == 4 * 3 * 8 + 4 * 3 * 4 == 144 and per_block % 16 == 0
    assert pool.shape == (2, 2, 5, per_block)
    k_cache, v_cache = caches[1]
    assert k_cache.shape == (5, 4, 3, 8) and k_cache.dtype == torch.int8
    k_cache.fill_(1)
    kv_quant.scales_of(k_cache).fill_(2.0)
    assert int(pool[1, 0].sum()) == 5 * (96 + 12 * sum(torch.tensor([2.0]).view(torch.uint8)))
    assert int(pool[0].sum()) == 0 and int(pool[1, 1].sum()) == 0
    assert v_cache.data_ptr() == pool[1, 1].data_ptr()


def test_a_block_s_scales_are_stored_head_major():
    """Each block's scales are ``[heads, tokens]`` (session 53): one KV head's scales over
    a page's tokens are adjacent, which the kernels read as runs (``scales_of``'s view
    still indexes ``[block, token, head]``)."""
    blocks, page, heads, dim = 3, 16, 4, 8
    cpu = torch.device("cpu")
    pool, [(k_cache, _)] = kv_quant.allocate(1, blocks, page, heads, dim, torch.int8, cpu)
    scales = kv_quant.scales_of(k_cache)
    assert scales.shape == (blocks, page, heads) and scales.stride()[1:] == (1, page)
    values = torch.arange(blocks * page * heads, dtype=torch.float32).view(blocks, page, heads)
    scales.copy_(values)
    raw = pool[0, 0, :, page * heads * dim :].contiguous().view(torch.float32)  # [blocks, ...]
    assert torch.equal(raw[:, : heads * page], values.transpose(1, 2).reshape(blocks, -1))


def test_unquantized_pool_is_the_plain_contiguous_layout():
    pool, caches = kv_quant.allocate(2, 5, 4, 3, 8, torch.bfloat16, torch.device("cpu"))
    assert pool.shape == (2, 2, 5, 4, 3, 8) and caches[0][0].is_contiguous()
    assert kv_quant.block_bytes(4, 3, 8, torch.bfloat16) == 4 * 3 * 8 * 2


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_reference_write_then_gather_returns_the_dequantized_rows(dtype):
    batch = make_batch([3, 1], [20, 5], device=DEVICE)
    k_cache, v_cache = quantized_copy(batch, dtype)
    write_kv_cache(batch.k, batch.v, k_cache, v_cache, batch.meta.slot_mapping)
    for b, seq_len in enumerate(batch.meta.seq_lens_cpu):
        for cache, full in ((k_cache, batch.full_k[b]), (v_cache, batch.full_v[b])):
            expected = kv_quant.dequantize(*kv_quant.quantize(full, dtype), torch.float32)
            got = gather_kv(cache, batch.meta.block_tables[b], seq_len)
            assert torch.equal(got.cpu(), expected)


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_torch_backend_over_a_quantized_cache_is_close_to_float_attention(dtype):
    batch = make_batch([5, 1, 12], [5, 40, 30], device=DEVICE)
    k_cache, v_cache = quantized_copy(batch, dtype)
    attn = TorchAttention(EngineConfig(), model_info(4, 2, 32, torch.float32, DEVICE))
    out = attn.forward(batch.q, batch.k, batch.v, k_cache, v_cache, batch.meta, batch.scale)
    error = relative_error(out, dense_reference(batch))
    assert 0 < error < QUANT_ERROR[dtype]


# --------------------------------------------------------------------------- Triton


def assert_same_quantized(got, ref, dtype):
    """The Triton-written cache equals the reference-written one bit for bit: scales,
    and values for int8 (same formula and rounding, ``kv_quant.INV_QMAX``); for fp8 see
    below."""
    assert torch.equal(kv_quant.scales_of(got), kv_quant.scales_of(ref))
    if dtype == torch.int8:
        differs = got != ref
        assert not differs.any(), f"{int(differs.sum())} int8 values differ"
        return
    values = kv_quant.dequantize(got, kv_quant.scales_of(got), torch.float32)
    expected = kv_quant.dequantize(ref, kv_quant.scales_of(ref), torch.float32)
    # fp8: within one ulp (2^-3 relative; the casts may round a tie differently). Under
    # the interpreter its e4m3 conversion is replaced by the GPU's rounding
    # (tests/interpreter_e4m3.py: it halved values whose rounding carried into the
    # exponent, 124.8 -> 64).
    differs = got.float() != ref.float()
    ulp = expected.abs() / 8 + kv_quant.scales_of(ref)[..., None] * 2**-9
    near = (values - expected).abs() <= ulp * 1.001
    assert torch.all(near)
    assert differs.float().mean() < 0.01


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("transposed", [False, True])  # fp8 values [heads, D, tokens]
@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_triton_kv_write_stores_what_the_reference_stores(dtype, transposed, block_size):
    batch = make_batch([3, 1, 6], [10, 17, 70], device=DEVICE, block_size=block_size)
    ref_k, ref_v = quantized_copy(batch, dtype, transposed)
    k_cache, v_cache = quantized_copy(batch, dtype, transposed)
    write_kv_cache(batch.k, batch.v, ref_k, ref_v, batch.meta.slot_mapping)
    write_kv(batch.k, batch.v, k_cache, v_cache, batch.meta.slot_mapping)
    assert_same_quantized(k_cache, ref_k, dtype)
    assert_same_quantized(v_cache, ref_v, dtype)


def test_reference_scale_is_the_absmax_times_the_fp32_reciprocal():
    # One formula on every device (torch on CUDA multiplies by the reciprocal when
    # dividing by a Python scalar, the CPU divides; the two differ by an ulp at times).
    x = torch.randn(4096, 2, 16, generator=torch.Generator().manual_seed(3), device="cpu")
    for dtype in KV_DTYPES:
        _, scales = kv_quant.quantize(x.to(DEVICE), dtype)
        inverse = torch.tensor(1.0 / kv_quant.QMAX[dtype], dtype=torch.float32)
        assert torch.equal(scales.cpu(), x.abs().amax(-1) * inverse)
        assert not torch.equal(scales.cpu(), x.abs().amax(-1) / kv_quant.QMAX[dtype])


def tie_rows(tokens, heads, dim, seed=0):
    """Keys whose int8 values lie at (or a few ulps from) .5 ties: rows of absmax
    ``127 u`` holding ``(k + 1/2) u`` (exact for the first half, whose ``u`` has a short
    mantissa; rounded for the rest), and rows with ``absmax / 2`` (63.5 nominally)."""
    gen = torch.Generator().manual_seed(seed)
    unit = 2.0 ** torch.empty(tokens, heads, 1).uniform_(-8, 4, generator=gen)
    short = 2.0 ** torch.randint(-8, 4, (tokens, heads, 1), generator=gen)
    short = short * (1 + torch.randint(0, 8, (tokens, heads, 1), generator=gen) / 8)
    unit[: tokens // 2] = short[: tokens // 2]
    half = torch.randint(0, 127, (tokens, heads, dim), generator=gen) + 0.5
    x = half * unit * torch.where(torch.rand(tokens, heads, dim, generator=gen) < 0.5, -1, 1)
    x[..., 0] = 127 * unit[..., 0]
    x[::2, :, 1] = x[::2, :, 0] / 2
    return x


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_triton_kv_write_rounds_ties_as_the_reference(dtype, transposed):
    # The GPU failure of issue 12: values an ulp from a .5 tie went the other way when
    # the kernel's scale or division was an ulp off the reference's.
    tokens, heads, dim = 64, 2, 32
    k = tie_rows(tokens, heads, dim).to(DEVICE)
    v = tie_rows(tokens, heads, dim, seed=1).to(DEVICE)
    slots = torch.randperm(tokens, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    shape = (tokens // 16, 16, heads, dim)
    (k_cache, v_cache), (ref_k, ref_v) = [
        kv_quant.allocate(1, *shape, dtype, torch.device(DEVICE), transposed)[1][0]
        for _ in range(2)
    ]
    write_kv_cache(k, v, ref_k, ref_v, slots)
    write_kv(k, v, k_cache, v_cache, slots)
    assert_same_quantized(k_cache, ref_k, dtype)
    assert_same_quantized(v_cache, ref_v, dtype)
    assert kv_quant.scales_of(ref_k).count_nonzero() == tokens * heads


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_fused_rope_kernel_writes_the_quantized_rotated_keys_and_values(dtype, transposed):
    batch = make_batch([3, 1, 6], [10, 17, 6], dtype=torch.float16, device=DEVICE)
    ref_k, ref_v = quantized_copy(batch, dtype, transposed)
    k_cache, v_cache = quantized_copy(batch, dtype, transposed)
    tokens, _, head_dim = batch.k.shape
    angles = torch.rand(tokens, 1, head_dim // 2, generator=torch.Generator().manual_seed(1))
    cos, sin = angles.cos().half().to(DEVICE), angles.sin().half().to(DEVICE)
    kv_write = (batch.v, k_cache, v_cache, batch.meta.slot_mapping)
    rope_ops.qk_norm_rope_(batch.q, batch.k, cos, sin, kv_write=kv_write)  # rotates k
    write_kv_cache(batch.k, batch.v, ref_k, ref_v, batch.meta.slot_mapping)
    assert_same_quantized(k_cache, ref_k, dtype)
    assert_same_quantized(v_cache, ref_v, dtype)


def poisoned(meta, page):
    """``meta`` with every table entry past its sequence's pages set to a block far
    outside any cache: a kernel that reads one faults (a wild address), where the zeros
    of ``make_batch``'s padding would pass unseen. The tables are exactly as wide as the
    longest sequence's pages, as the engine's are, so a read past the last row's pages
    leaves the tensor."""
    tables = meta.block_tables.clone()
    for row, seq_len in enumerate(meta.seq_lens_cpu):
        tables[row, -(-seq_len // page) :] = 2**30
    return dataclasses.replace(meta, block_tables=tables)


def check_triton_against_torch(
    query_lens, seq_lens, kv_dtype, dtype=torch.float32, v_transposed=False, block_size=16,
    poison=False, **settings,
):  # fmt: skip
    batch = make_batch(query_lens, seq_lens, dtype=dtype, device=DEVICE, block_size=block_size)
    info = model_info(4, 2, 32, dtype, DEVICE)
    triton_attn = TritonAttention(EngineConfig(block_size=block_size), info, **settings)
    torch_attn = TorchAttention(EngineConfig(), info)
    # the layout the backend asks for (fp8 values transposed with decode_fp8_mma), or
    # transposed anyway (the f16 kernels over it)
    transposed = triton_attn.fp8_values_transposed or v_transposed
    k_cache, v_cache = quantized_copy(batch, kv_dtype, transposed)
    ref_k, ref_v = quantized_copy(batch, kv_dtype)
    # The reference writes both caches (the Triton write is checked above; the
    # interpreter's fp8 rounding differs from the GPU's), so the kernels read the same KV.
    write_kv_cache(batch.k, batch.v, k_cache, v_cache, batch.meta.slot_mapping)
    meta = poisoned(batch.meta, block_size) if poison else batch.meta
    triton_attn.prepare(meta)
    out = triton_attn.forward(
        batch.q, batch.k, batch.v, k_cache, v_cache, meta, batch.scale, kv_written=True
    )
    reference = torch_attn.forward(batch.q, batch.k, batch.v, ref_k, ref_v, batch.meta, batch.scale)
    assert torch.isfinite(out).all()
    fp8 = kv_dtype == torch.float8_e4m3fn
    fp8_mma = fp8 and triton_attn.resolved.decode_fp8_mma
    # the prefill's fp8 products (prefill_fp8_mma) need 16-bit queries and values
    # stored transposed
    prefill_mma = (
        fp8
        and triton_attn.resolved.prefill_fp8_mma
        and transposed
        and dtype != torch.float32
        and triton_attn.resolved.prefill_tiles[True]["prefill_block_n"] >= 32
    )
    agreement = FP8_MMA_AGREEMENT if fp8_mma else AGREEMENT[dtype]
    decodes = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
    error = relative_error(out[:decodes], reference[:decodes].double().cpu())
    assert error < agreement
    if decodes < out.shape[0]:  # the prefill kernel's rows (f16 arithmetic, or fp8)
        prefill = relative_error(out[decodes:], reference[decodes:].double().cpu())
        assert prefill < (FP8_MMA_AGREEMENT if prefill_mma else AGREEMENT[dtype])
    assert relative_error(out, dense_reference(batch)) < QUANT_ERROR[kv_dtype] + (
        FP8_MMA_AGREEMENT if fp8_mma or prefill_mma else 0
    )
    return error


# (decode_fp8_mma, values transposed): the f16 kernel over values as stored (the
# interpreter's default); the fp8-MMA kernel over its layout (the GPU's default);
# the f16 kernel over that layout
LAYOUTS = [(0, False), (1, True), (0, True)]


@pytest.mark.parametrize(("fp8_mma", "transposed"), LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_triton_decode_over_a_quantized_cache_matches_the_reference(
    kv_dtype, dtype, fp8_mma, transposed, monkeypatch
):
    calls = []
    monkeypatch.setattr(decode_fp8_mma, "decode_fp8_mma", _counted(decode_fp8_mma, calls))
    error = check_triton_against_torch(
        [1, 1, 1], [150, 17, 40], kv_dtype, dtype, transposed, max_num_splits=4,
        decode_fp8_mma=fp8_mma,
    )  # fmt: skip
    # an fp8 cache takes the fp8-MMA kernel when it is on (the backend then asks for
    # transposed values), never otherwise
    assert len(calls) == (1 if fp8_mma and kv_dtype == torch.float8_e4m3fn else 0)
    if calls:
        assert error > 1e-4  # q and p rounded to e4m3: not the f16 kernel's result


def _counted(module, calls):
    original = module.decode_fp8_mma

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    return counted


@pytest.mark.parametrize("kv_f16", [1, 0])  # the prefill's products in f16, or in q's dtype
@pytest.mark.parametrize(("fp8_mma", "transposed"), LAYOUTS)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_triton_prefill_and_decodes_over_a_quantized_cache_match_the_reference(
    kv_dtype, fp8_mma, transposed, kv_f16
):
    check_triton_against_torch(
        [1, 9, 20], [30, 9, 45], kv_dtype, torch.float16, transposed, decode_fp8_mma=fp8_mma,
        prefill_kv_f16=kv_f16,
    )  # fmt: skip


@pytest.mark.parametrize("ahead", [0, 1])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_no_kernel_reads_a_table_entry_past_a_sequence_s_pages(kv_dtype, ahead):
    # prompts shorter than a prefill tile (no unmasked tile: the look-ahead must load
    # nothing), across tiles, and decodes; every padding entry points far outside the
    # cache (session 55: the head-major scales' unmasked look-ahead read tile 0's table
    # entries for a 9-token prompt, past the table's end on the GPU)
    check_triton_against_torch(
        [1, 9, 20, 40], [30, 9, 45, 100], kv_dtype, torch.float16, poison=True,
        prefill_meta_ahead=ahead, prefill_block_n=32,
    )  # fmt: skip


@pytest.mark.parametrize("block_size", [32, 64])
@pytest.mark.parametrize(("fp8_mma", "transposed"), LAYOUTS)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_pages_of_32_and_64_tokens_prefill_and_decode_like_the_reference(
    kv_dtype, fp8_mma, transposed, block_size
):
    # decodes over several pages and a partial one, then prompts inside and across pages
    check_triton_against_torch(
        [1, 1, 9, 20], [150, 70, 9, 45], kv_dtype, torch.float16, transposed,
        block_size=block_size, max_num_splits=4, decode_fp8_mma=fp8_mma,
    )  # fmt: skip


def test_the_f16_prefill_holds_bf16_queries_beyond_f16_range():
    # bf16 queries enter an fp8 cache's f16 products: rows above f16's 65,504 are shrunk
    # first and the scores undo it (without the shrink a row turns to inf and its output
    # to NaN; without the undo the scores shrink with it). Every query is scaled up and
    # the softmax scale down by the same factor, so the softmax is not one-hot. The
    # interpreter runs this path right, its products being f16 (bf16 dots it gets wrong)
    kv_dtype = torch.float8_e4m3fn
    batch = make_batch([9, 20], [9, 45], dtype=torch.bfloat16, device=DEVICE)
    factor = 2.0**17  # |q| far past f16's range; a power of two keeps q's bf16 digits
    batch.q.mul_(factor)
    batch.scale /= factor
    info = model_info(4, 2, 32, torch.bfloat16, DEVICE)
    attn = TritonAttention(EngineConfig(), info)
    assert attn.resolved.prefill_kv_f16
    k_cache, v_cache = quantized_copy(batch, kv_dtype, attn.fp8_values_transposed)
    ref_k, ref_v = quantized_copy(batch, kv_dtype)
    write_kv_cache(batch.k, batch.v, k_cache, v_cache, batch.meta.slot_mapping)
    out = attn.forward(
        batch.q, batch.k, batch.v, k_cache, v_cache, batch.meta, batch.scale, kv_written=True
    )
    reference = TorchAttention(EngineConfig(), info).forward(
        batch.q, batch.k, batch.v, ref_k, ref_v, batch.meta, batch.scale
    )
    assert torch.isfinite(out).all()
    assert relative_error(out, reference.double().cpu()) < 2e-2  # bf16 outputs
    assert relative_error(out[3:4], reference[3:4].double().cpu()) < 2e-2
