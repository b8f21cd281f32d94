"""The fp8 cache's transposed value pages (``kv_quant.allocate``) and the decode kernel
that multiplies them in fp8 (``triton_kernels/decode_fp8_mma.py``), against the torch
reference path over the same cache. Without a GPU the kernel runs under
TRITON_INTERPRET=1: its fp8 ``tl.dot`` is exact there, and its e4m3 conversions are the
GPU's (``tests/interpreter_e4m3.py``)."""

from __future__ import annotations

import pytest
import torch
from paged_batches import make_batch, model_info, relative_error
from test_kv_quant import DEVICE, quantized_copy

from tokenloom.config import EngineConfig
from tokenloom.plugins.attention import kv_quant
from tokenloom.plugins.attention.torch_backend import TorchAttention, write_kv_cache
from tokenloom.plugins.attention.triton_backend import TritonAttention
from tokenloom.plugins.attention.triton_kernels import decode_fp8_mma as decode_fp8_mma_module
from tokenloom.plugins.attention.triton_kernels.decode_fp8_mma import decode_fp8_mma, supports
from tokenloom.plugins.attention.triton_settings import cuda_defaults

# on a GPU these are GPU tests (the kernel runs there), so `pytest -m gpu` selects them
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []

FP8 = torch.float8_e4m3fn


def test_an_fp8_pool_stores_its_values_transposed_per_block():
    cpu = torch.device("cpu")
    _, [(_, plain_v)] = kv_quant.allocate(1, 3, 16, 2, 8, FP8, cpu)  # the default: as stored
    assert not kv_quant.v_transposed(plain_v)
    pool, [(k_cache, v_cache)] = kv_quant.allocate(1, 3, 16, 2, 8, FP8, cpu, v_transposed=True)
    per_block = kv_quant.block_bytes(16, 2, 8, FP8)
    assert v_cache.shape == k_cache.shape == (3, 16, 2, 8)
    assert k_cache.stride() == (per_block, 16, 8, 1)
    assert v_cache.stride() == (per_block, 1, 16 * 8, 16)
    assert kv_quant.v_transposed(v_cache) and not kv_quant.v_transposed(k_cache)
    _, [(_, int8_v)] = kv_quant.allocate(1, 3, 16, 2, 8, torch.int8, cpu, v_transposed=True)
    assert not kv_quant.v_transposed(int8_v)  # fp8 only
    # token 5 of block 2, head 1: value d sits at head * D * page + d * page + 5
    k = torch.zeros(1, 2, 8)
    v = torch.zeros(1, 2, 8)
    v[0, 1] = torch.arange(1, 9, dtype=torch.float32)
    write_kv_cache(k, v, k_cache, v_cache, torch.tensor([2 * 16 + 5]))
    raw = pool[0, 1, 2, : 16 * 2 * 8].view(FP8).float()  # the block's data, not its scales
    scale = float(kv_quant.scales_of(v_cache)[2, 5, 1])
    assert scale == pytest.approx(8 / 448)
    placed = raw[1 * 8 * 16 + torch.arange(8) * 16 + 5] * scale
    assert torch.allclose(placed, v[0, 1], rtol=2**-4)
    assert int(raw.count_nonzero()) == 8  # nothing else written in the block's data


def _reference(batch, info):
    """The torch backend writing and attending over its own quantized cache."""
    k_cache, v_cache = quantized_copy(batch, FP8)
    return TorchAttention(EngineConfig(), info).forward(
        batch.q, batch.k, batch.v, k_cache, v_cache, batch.meta, batch.scale
    )


# Per request row: q's and P's e4m3 rounding stays below this (2.0-4.1% measured); a
# kernel that drops a tile's offset to the running maximum (below) is off by up to 0.47.
ROW_BOUND = 8e-2


@pytest.mark.parametrize(
    ("splits", "block_n", "page"),
    [
        *((s, n, 16) for s, n in [(1, 32), (4, 32), (3, 64), (2, 128), (1, 64), (1, 128)]),
        # pages that hold whole tiles: one block number a tile (a scalar load), the tile's
        # slots from the page's start or its middle (page 128, tiles of 32 or 64)
        (1, 32, 64), (2, 64, 64), (3, 32, 128), (1, 64, 128), (2, 128, 32),
    ],
)  # fmt: skip
def test_decode_fp8_mma_merges_splits_and_tail_tiles_like_the_reference(splits, block_n, page):
    # lengths: one token, a page, a page and one, several tiles and a tail; a padding row
    seq_lens = [1, 16, 17, 150, 77]
    batch = make_batch(
        [1] * 5, seq_lens, dtype=torch.float16, device=DEVICE, seed=splits, padding_rows=1,
        block_size=page,
    )  # fmt: skip
    # request 3's largest scores in its first tile: the later tiles sit far below the
    # running maximum, which their sums must carry
    table3 = batch.meta.block_tables[3].long()
    batch.k_cache[table3[0], :4] = 3 * batch.q[3, ::2].to(batch.k_cache.dtype).cpu()
    info = model_info(4, 2, 32, torch.float16, DEVICE)
    k_cache, v_cache = quantized_copy(batch, FP8, v_transposed=True)
    write_kv_cache(batch.k, batch.v, k_cache, v_cache, batch.meta.slot_mapping)
    assert supports(batch.q, k_cache, v_cache)
    out = torch.full_like(batch.q, float("nan"))
    part_out = torch.zeros(6 * 4 * splits * 32, device=DEVICE)  # 6 rows, 4 heads, D 32
    part_lse = torch.zeros(6 * 4 * splits, device=DEVICE)
    counters = torch.zeros(6 * 2, dtype=torch.int32, device=DEVICE)
    decode_fp8_mma(
        batch.q, k_cache, v_cache, batch.meta.block_tables, batch.meta.seq_lens, out,
        part_out, part_lse, counters, batch.scale, splits, block_n=block_n,
    )  # fmt: skip
    assert torch.equal(out[5], torch.zeros_like(out[5]))  # the padding row: zeros
    assert torch.isfinite(out).all()
    assert int(counters.count_nonzero()) == 0  # left zero for the next launch
    ref = _reference(batch, info).double().cpu()
    for row in range(5):
        assert relative_error(out[row : row + 1], ref[row : row + 1]) < ROW_BOUND, row
    # a request of one token attends to its own value only: p' = 448 exactly
    block = batch.meta.block_tables[0, 0].long()
    one = v_cache[block, 0].float() * kv_quant.scales_of(v_cache)[block, 0][:, None]
    assert torch.allclose(out[0].float(), one.repeat_interleave(2, 0), rtol=1e-2, atol=1e-3)
    # the block numbers loaded a tile ahead (session 35): the same arithmetic, bit for bit,
    # at the default stages and at the pipelined ones with a register cap (on a GPU; the
    # interpreter ignores both). Pages of 16 and tiles of 32 or more: never the fallback
    for stages, maxnreg in ((2, 0), (3, 128)):
        ahead = torch.full_like(batch.q, float("nan"))
        decode_fp8_mma(
            batch.q, k_cache, v_cache, batch.meta.block_tables, batch.meta.seq_lens, ahead,
            part_out, part_lse, counters, batch.scale, splits, block_n=block_n,
            num_stages=stages, maxnreg=maxnreg, meta_ahead=True,
        )  # fmt: skip
        assert torch.equal(ahead, out), (stages, maxnreg)
        assert int(counters.count_nonzero()) == 0
    # one reduction a tile (session 38): the same maximum, lift and products, the sums
    # per token to the end, so the output moves by the sums' rounding only
    for meta_ahead in (False, True):
        folded = torch.full_like(batch.q, float("nan"))
        decode_fp8_mma(
            batch.q, k_cache, v_cache, batch.meta.block_tables, batch.meta.seq_lens, folded,
            part_out, part_lse, counters, batch.scale, splits, block_n=block_n,
            num_stages=3, meta_ahead=meta_ahead, fold=True,
        )  # fmt: skip
        assert torch.allclose(folded.float(), out.float(), rtol=2e-3, atol=1e-5), meta_ahead
        assert int(counters.count_nonzero()) == 0


def test_pages_the_fp8_mma_kernel_does_not_take_go_to_the_f16_kernel(monkeypatch):
    # pages of 8 tokens: V^T rows shorter than 16 bytes; the f16 kernel reads them strided
    batch = make_batch([1, 1, 1], [40, 9, 100], dtype=torch.float16, device=DEVICE, block_size=8)
    info = model_info(4, 2, 32, torch.float16, DEVICE)
    k_cache, v_cache = quantized_copy(batch, FP8, v_transposed=True)
    write_kv_cache(batch.k, batch.v, k_cache, v_cache, batch.meta.slot_mapping)
    assert kv_quant.v_transposed(v_cache) and not supports(batch.q, k_cache, v_cache)
    attn = TritonAttention(EngineConfig(), info, max_num_splits=4, decode_fp8_mma=1)
    monkeypatch.setattr(attn, "_decode_fp8_mma", None)  # never called for these pages
    attn.prepare(batch.meta)
    out = attn.forward(
        batch.q, batch.k, batch.v, k_cache, v_cache, batch.meta, batch.scale, kv_written=True
    )
    ref = _reference(batch, info)
    assert relative_error(out, ref.double().cpu()) < 3e-3  # f16 arithmetic


def test_the_engine_allocates_the_layout_its_backend_asks_for_and_decodes_through_it(
    tiny_model_factory, monkeypatch
):
    """decode_fp8_mma = 1: the pool's fp8 values transposed, every decode step through the
    fp8-MMA kernel (under the interpreter), and the sampled tokens' logprobs within the
    kernel's rounding of the f16 kernel's over the default layout."""
    from tokenloom import LLM, SamplingParams
    from tokenloom.plugins.attention.triton_kernels import decode_fp8_mma

    model = str(tiny_model_factory("llama", hidden_size=128))  # head_dim 32: the MMA's K
    greedy = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6, logprobs=0)
    prompts = [[5, 6, 7, 8] * 5, [9, 10, 11]]
    tokens, logprobs = {}, {}
    calls: list[int] = []
    original = decode_fp8_mma.decode_fp8_mma
    monkeypatch.setattr(
        decode_fp8_mma, "decode_fp8_mma", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    for on in (0, 1):
        calls.clear()
        llm = LLM(
            model, dtype="float32", attention="triton", kv_cache_dtype="fp8",
            plugin={"triton": {"decode_fp8_mma": on}},
        )  # fmt: skip
        k_cache, v_cache = llm.engine.executor.kv_caches[0]
        assert kv_quant.v_transposed(v_cache) == bool(on) and not kv_quant.v_transposed(k_cache)
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        tokens[on] = [o.outputs[0].token_ids for o in outs]
        logprobs[on] = torch.tensor(  # each token's {token id: logprob}: the sampled one's
            [_sampled(o.outputs[0]) for o in outs]
        )
        llm.engine.shutdown()
        assert (len(calls) > 0) == bool(on)  # 5 decode steps x the model's layers when on
    assert tokens[1] == tokens[0]  # deterministic here; a flipped near tie would show
    # the decoded tokens' logprobs (the first comes from prefill, the same kernel both ways)
    assert torch.equal(logprobs[1][:, 0], logprobs[0][:, 0])
    drift = (logprobs[1][:, 1:] - logprobs[0][:, 1:]).abs().max().item()
    assert 0 < drift < 0.05, drift


def _sampled(completion):
    pairs = zip(completion.logprobs, completion.token_ids, strict=True)
    return [logprobs[token] for logprobs, token in pairs]


@pytest.mark.parametrize("group", [1, 3, 8, 15, 16])
def test_the_fold_follows_the_unfolded_kernel_at_every_group_size(group, monkeypatch):
    # group 16 fills the MMA's 16 columns: no padding head to carry the values' scale, so
    # the launcher must leave the fold off there (with it, the lift would be 448 / 0)
    batch = make_batch(
        [1] * 3, [16, 77, 150], num_heads=group, num_kv_heads=1, dtype=torch.float16,
        device=DEVICE, seed=group,
    )  # fmt: skip
    k_cache, v_cache = quantized_copy(batch, FP8, v_transposed=True)
    # value rows of very different sizes: the lift follows the tile's largest scale
    scales = kv_quant.scales_of(v_cache)
    scales.mul_(torch.logspace(-2, 2, scales.numel(), device=scales.device).view_as(scales))
    write_kv_cache(batch.k, batch.v, k_cache, v_cache, batch.meta.slot_mapping)
    launched = []
    kernel = decode_fp8_mma_module._decode_fp8_mma_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append(kwargs["FOLD"])
                return kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(decode_fp8_mma_module, "_decode_fp8_mma_kernel", Spy())

    def run(fold):
        out = torch.full_like(batch.q, float("nan"))
        part_out = torch.zeros(3 * group * 2 * 32, device=DEVICE)
        part_lse = torch.zeros(3 * group * 2, device=DEVICE)
        counters = torch.zeros(3, dtype=torch.int32, device=DEVICE)
        decode_fp8_mma(
            batch.q, k_cache, v_cache, batch.meta.block_tables, batch.meta.seq_lens, out,
            part_out, part_lse, counters, batch.scale, 2, block_n=64, fold=fold,
        )  # fmt: skip
        return out

    plain, folded = run(False), run(True)
    assert launched == [False, group < 16]
    assert torch.isfinite(folded).all()
    assert torch.allclose(folded.float(), plain.float(), rtol=2e-3, atol=1e-5)
    info = model_info(group, 1, 32, torch.float16, DEVICE)  # over the same cache
    ref = TorchAttention(EngineConfig(), info).forward(
        batch.q, batch.k, batch.v, k_cache, v_cache, batch.meta, batch.scale
    )
    ref = ref.double().cpu()
    for row in range(3):
        assert relative_error(folded[row : row + 1], ref[row : row + 1]) < ROW_BOUND, row


def test_stale_slots_past_a_request_s_end_never_reach_its_output():
    """The last page's slots past a request's length hold whatever their block held
    before (here NaN bytes and NaN scales); the partial tile zeroes them (0 * NaN is NaN
    in the products). Off the GPU this needs the interpreter's e4m3 reads fixed
    (``tests/interpreter_e4m3.py``: it read the NaN byte as 480); ``test_kv_quant_gpu``
    runs it on the device too."""
    batch = make_batch([1, 1], [37, 130], dtype=torch.float16, device=DEVICE)
    k_cache, v_cache = quantized_copy(batch, FP8, v_transposed=True)
    write_kv_cache(batch.k, batch.v, k_cache, v_cache, batch.meta.slot_mapping)

    def run(meta_ahead=False, fold=False):
        out = torch.empty_like(batch.q)
        part_out, part_lse = torch.zeros(2 * 4 * 2 * 32), torch.zeros(2 * 4 * 2)
        counters = torch.zeros(2 * 2, dtype=torch.int32)
        decode_fp8_mma(
            batch.q, k_cache, v_cache, batch.meta.block_tables, batch.meta.seq_lens, out,
            part_out.to(DEVICE), part_lse.to(DEVICE), counters.to(DEVICE), batch.scale, 2,
            block_n=32, meta_ahead=meta_ahead, fold=fold,
        )  # fmt: skip
        return out

    clean = run()
    for b, seq_len in enumerate((37, 130)):
        block = batch.meta.block_tables[b, seq_len // 16].long()
        for cache in (k_cache, v_cache):
            cache.view(torch.uint8)[block, seq_len % 16 :] = 0x7F  # e4m3 NaN
            kv_quant.scales_of(cache)[block, seq_len % 16 :] = float("nan")
    assert torch.isnan(v_cache[block, 15].float()).all()
    assert torch.equal(run(), clean)
    assert torch.equal(run(meta_ahead=True), clean)  # its block numbers a tile ahead
    assert torch.allclose(run(fold=True), clean, rtol=2e-3, atol=1e-5)  # one reduction


def test_the_meta_ahead_setting_reaches_the_launcher(monkeypatch):
    seen = []
    monkeypatch.setattr(decode_fp8_mma_module, "decode_fp8_mma", lambda *a, **kw: seen.append(kw))
    info = model_info(4, 2, 32, torch.float16, DEVICE)
    for value in (0, 1):
        attn = TritonAttention(EngineConfig(), info, decode_fp8_mma=1, decode_fp8_meta_ahead=value)
        attn._decode_fp8_mma(num_stages=2, maxnreg=0, kv_asm=True, rope=None, prefetch=False)
    assert [kw["meta_ahead"] for kw in seen] == [False, True]


def test_the_fold_setting_reaches_the_launcher(monkeypatch):
    seen = []
    monkeypatch.setattr(decode_fp8_mma_module, "decode_fp8_mma", lambda *a, **kw: seen.append(kw))
    info = model_info(4, 2, 32, torch.float16, DEVICE)
    for value in (None, 0, 1):
        options = {} if value is None else {"decode_fp8_fold": value}
        attn = TritonAttention(EngineConfig(), info, decode_fp8_mma=1, **options)
        attn._decode_fp8_mma(num_stages=2, maxnreg=0, kv_asm=True, rope=None, prefetch=False)
    default = bool(cuda_defaults(32)["decode_fp8_fold"]) if DEVICE == "cuda" else False
    assert [kw["fold"] for kw in seen] == [default, False, True]


def test_a_cache_view_with_unaligned_blocks_goes_to_the_f16_kernel():
    batch = make_batch([1], [40], dtype=torch.float16, device=DEVICE)
    k_cache, v_cache = quantized_copy(batch, FP8, v_transposed=True)
    assert supports(batch.q, k_cache, v_cache)
    shifted = k_cache.as_strided(k_cache.shape, (k_cache.stride(0) + 8, *k_cache.stride()[1:]))
    assert not supports(batch.q, shifted, v_cache)  # the values' contiguity hint needs 16


def test_the_setting_is_off_with_a_warning_for_shapes_the_kernel_cannot_take(caplog):
    info = model_info(4, 2, 16, torch.float16, DEVICE)  # head_dim 16: an 8-bit dot's K < 32
    with caplog.at_level("WARNING", logger="tokenloom.attention"):
        attn = TritonAttention(EngineConfig(), info, decode_fp8_mma=1)
    assert not attn.resolved.decode_fp8_mma and not attn.fp8_values_transposed
    assert "decode_fp8_mma: off for head_dim 16" in caplog.text
    pages_of_8 = TritonAttention(
        EngineConfig(block_size=8), model_info(4, 2, 32, torch.float16, DEVICE), decode_fp8_mma=1
    )
    assert not pages_of_8.fp8_values_transposed
    assert TritonAttention(
        EngineConfig(), model_info(4, 2, 32, torch.float16, DEVICE), decode_fp8_mma=1
    ).fp8_values_transposed


def test_the_backend_s_mma_tiles_reach_the_launcher(monkeypatch):
    # MMA_DECODE applies on CUDA only (mma_decode_tiles, tested in test_triton_backend);
    # whatever the backend chose, its tile, stages, cap and lookahead are what launch
    seen = []
    monkeypatch.setattr(decode_fp8_mma_module, "decode_fp8_mma", lambda *a, **kw: seen.append(kw))
    info = model_info(4, 2, 32, torch.float16, DEVICE)
    attn = TritonAttention(EngineConfig(), info, decode_fp8_mma=1)
    options = dict(block_n=128, num_stages=2, maxnreg=0, kv_asm=True, rope=None, prefetch=False)
    attn.resolved.mma_decode_block_n = 0  # none chosen: the decode's own block (decode_block_n_for)
    attn._decode_fp8_mma(**options)
    attn.resolved.mma_decode_block_n, attn.resolved.mma_decode_num_stages = 64, 3
    attn.resolved.mma_decode_maxnreg, attn.resolved.mma_decode_meta_ahead = 128, True
    attn._decode_fp8_mma(**options)
    picked = [(kw["block_n"], kw["num_stages"], kw["maxnreg"], kw["meta_ahead"]) for kw in seen]
    assert picked[0][0] == 128
    assert picked[1] == (64, 3, 128, True)
