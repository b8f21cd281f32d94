"""An 8-bit cache's prefill kernel variants (session 52): the fp8-MMA prefill
(``prefill_fp8_mma``: both products in fp8) against the reference, beside an attention
sink, and the unmasked tiles' blocks and scales loaded a tile ahead
(``prefill_meta_ahead``), which must change no result. The shared checks and bounds are
``test_kv_quant.py``'s."""

from __future__ import annotations

import logging

import pytest
import torch
from paged_batches import make_batch, model_info, relative_error
from test_kv_quant import DEVICE, check_triton_against_torch, quantized_copy

from tokenloom.config import EngineConfig
from tokenloom.plugins.attention.torch_backend import TorchAttention, write_kv_cache
from tokenloom.plugins.attention.triton_backend import TritonAttention

# on a GPU these are GPU tests (the kernels run there), so `pytest -m gpu` selects them
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []

# the fp8-MMA prefill (its fp8 dots take K >= 32: KV tiles of 32 under the interpreter)
MMA_PREFILL = {"decode_fp8_mma": 1, "prefill_fp8_mma": 1, "prefill_block_n": 32}


def _prefill_out(batch, info, block_size, kv_dtype=torch.float8_e4m3fn, **settings):
    """The Triton backend's output over an 8-bit cache in the layout it asks for."""
    attn = TritonAttention(EngineConfig(block_size=block_size), info, **settings)
    k_cache, v_cache = quantized_copy(batch, kv_dtype, attn.fp8_values_transposed)
    write_kv_cache(batch.k, batch.v, k_cache, v_cache, batch.meta.slot_mapping)
    attn.prepare(batch.meta)
    return attn.forward(
        batch.q, batch.k, batch.v, k_cache, v_cache, batch.meta, batch.scale, kv_written=True
    )


@pytest.mark.parametrize("block_size", [16, 64])
def test_the_fp8_mma_prefill_matches_the_reference(block_size):
    """``prefill_fp8_mma``: an fp8 cache's prefill with both products in fp8 (q and
    ``p * v_scale`` rounded to e4m3), over pages of 16 and 64, prompts with a cached
    prefix and without, inside a page and across pages, beside decodes."""
    query_lens, seq_lens = [1, 9, 20, 70], [30, 9, 45, 150]
    check_triton_against_torch(
        query_lens, seq_lens, torch.float8_e4m3fn, torch.float16, True, block_size=block_size,
        decode_fp8_mma=1, prefill_fp8_mma=1, prefill_block_n=32,
    )  # fmt: skip
    # it is the fp8 path: not the f16 products' result (those agree to 3e-3)
    batch = make_batch(query_lens, seq_lens, dtype=torch.float16, device=DEVICE,
                       block_size=block_size)  # fmt: skip
    info = model_info(4, 2, 32, torch.float16, DEVICE)
    mma = _prefill_out(batch, info, block_size, **MMA_PREFILL)
    f16 = _prefill_out(batch, info, block_size, **{**MMA_PREFILL, "prefill_fp8_mma": 0})
    assert relative_error(mma[1:], f16[1:].double().cpu()) > 1e-3
    assert torch.equal(mma[:1], f16[:1])  # the decode row is the decode kernel's either way


def test_the_fp8_mma_prefill_keeps_keys_far_below_an_attention_sink():
    """A sink key at position 0 scores 12 nats above every other key (whose own scores
    spread by about a quarter of a nat), and the first KV tile's values are zero, so the
    output is the later tiles' alone, each probability about 6e-6 of the sink's. Taken
    relative to the running maximum, p * 448 falls into e4m3's subnormals (steps of
    2^-9, about the values themselves: 30-40% off); taken relative to each tile's own
    maximum it keeps e4m3's relative precision. The sink's score is exact in e4m3 (one
    channel, each row's and the key's largest), so the queries' rounding does not move
    its weight."""
    dtype, block_size, head_dim = torch.float16, 16, 32
    batch = make_batch([20], [300], dtype=dtype, device=DEVICE, block_size=block_size)
    batch.q.clamp_(-4, 4)
    batch.q[..., 0] = 8.0  # every row's largest: 448 in e4m3, exactly
    batch.k_cache *= 0.25  # the other keys' scores within about a quarter of a nat
    batch.k *= 0.25
    first = int(batch.meta.block_tables[0, 0])
    batch.k_cache[first, 0] = 0
    batch.k_cache[first, 0, :, 0] = 12.0 / (8.0 * batch.scale)  # q . k x scale = 12
    tile = MMA_PREFILL["prefill_block_n"]  # the first KV tile's values: all zero
    for page in range(tile // block_size):
        batch.v_cache[int(batch.meta.block_tables[0, page])] = 0
    batch.full_k[0][0] = batch.k_cache[first, 0].cpu()
    batch.full_v[0][:tile] = 0
    info = model_info(4, 2, head_dim, dtype, DEVICE)
    out = _prefill_out(batch, info, block_size, **MMA_PREFILL)
    ref_k, ref_v = quantized_copy(batch, torch.float8_e4m3fn)
    write_kv_cache(batch.k, batch.v, ref_k, ref_v, batch.meta.slot_mapping)
    reference = TorchAttention(EngineConfig(), info).forward(
        batch.q, batch.k, batch.v, ref_k, ref_v, batch.meta, batch.scale
    )
    magnitude = float(reference.double().abs().mean())
    assert 1e-6 < magnitude < 1e-3  # the later tiles' small share, not the sink's
    assert relative_error(out, reference.double().cpu()) < 5e-2


AHEAD_CACHES = [(torch.float8_e4m3fn, 0), (torch.float8_e4m3fn, 1), (torch.int8, 0)]


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize(("kv_dtype", "fp8_mma"), AHEAD_CACHES)
def test_the_prefill_s_blocks_and_scales_a_tile_ahead_change_no_result(
    kv_dtype, fp8_mma, block_size
):
    """``prefill_meta_ahead``: the unmasked tiles' blocks and scales come from registers
    loaded a tile earlier; the arithmetic is the same, so the output is,
    to the bit (the last tile's look-ahead past the unmasked tiles reads block 0 and is
    dropped)."""
    batch = make_batch([1, 9, 20, 70], [30, 9, 45, 150], dtype=torch.float16, device=DEVICE,
                       block_size=block_size)  # fmt: skip
    info = model_info(4, 2, 32, torch.float16, DEVICE)
    settings = {**MMA_PREFILL, "prefill_fp8_mma": fp8_mma}
    plain = _prefill_out(batch, info, block_size, kv_dtype, **settings, prefill_meta_ahead=0)
    early = _prefill_out(batch, info, block_size, kv_dtype, **settings, prefill_meta_ahead=1)
    assert torch.equal(plain, early)
    check_triton_against_torch(
        [1, 9, 20, 70], [30, 9, 45, 150], kv_dtype, torch.float16, True,
        block_size=block_size, **settings, prefill_meta_ahead=1,
    )  # fmt: skip


def test_the_prefill_settings_reach_the_launcher(monkeypatch):
    """The look-ahead and the fp8 products as set reach ``prefill_attention`` (the
    equality test above would also pass if they were dropped on the way)."""
    from tokenloom.plugins.attention import triton_backend

    seen, original = [], triton_backend.prefill_attention

    def spy(*args, **kwargs):
        seen.append((kwargs["meta_ahead"], kwargs["fp8_mma"]))
        return original(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "prefill_attention", spy)
    batch = make_batch([9, 20], [9, 45], dtype=torch.float16, device=DEVICE)
    info = model_info(4, 2, 32, torch.float16, DEVICE)
    for ahead, mma in [(0, 0), (1, 0), (1, 1)]:
        settings = {**MMA_PREFILL, "prefill_fp8_mma": mma, "prefill_meta_ahead": ahead}
        _prefill_out(batch, info, 16, **settings)
    assert seen == [(False, False), (True, False), (True, True)]


def test_the_prefill_settings_refuse_or_warn_where_they_cannot_apply(caplog):
    """``prefill_meta_ahead`` takes 0 or 1; ``prefill_fp8_mma`` asked for where it cannot
    apply (fp32 queries, values not transposed, 16-token KV tiles) is off, with a warning
    (it was a silent no-op before session 53)."""
    info16 = model_info(4, 2, 32, torch.float16, DEVICE)
    with pytest.raises(ValueError, match="prefill_meta_ahead: 0 or 1, not 2"):
        TritonAttention(EngineConfig(), info16, prefill_meta_ahead=2)
    assert TritonAttention(EngineConfig(), info16, **MMA_PREFILL).resolved.prefill_fp8_mma
    where_not = [
        (model_info(4, 2, 32, torch.float32, DEVICE), MMA_PREFILL),
        (info16, {**MMA_PREFILL, "decode_fp8_mma": 0}),
        (info16, {**MMA_PREFILL, "prefill_block_n": 16}),
    ]
    for info, settings in where_not:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tokenloom.attention"):
            attn = TritonAttention(EngineConfig(), info, **settings)
        assert not attn.resolved.prefill_fp8_mma, settings
        assert "prefill_fp8_mma: off" in caplog.text, settings
    caplog.clear()
    with caplog.at_level(
        logging.WARNING, logger="tokenloom.attention"
    ):  # not asked for: no warning
        TritonAttention(EngineConfig(), model_info(4, 2, 32, torch.float32, DEVICE))
    assert "prefill_fp8_mma" not in caplog.text
