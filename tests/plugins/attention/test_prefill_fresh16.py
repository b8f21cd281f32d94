"""``prefill_fresh_16bit`` (session 38, opt-in): with an 8-bit KV cache, the prefill of
requests with no cached prefix reads their own 16-bit keys and values (a cache of one-token
pages over the step's rows) instead of the quantized cache; every other request, and every
decode, still reads the cache. Without a GPU the kernels run under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch
from paged_batches import dense_reference, make_batch, model_info, relative_error
from test_kv_quant import AGREEMENT, DEVICE, KV_DTYPES, quantized_copy

from tokenloom.config import EngineConfig
from tokenloom.plugins.attention import triton_backend
from tokenloom.plugins.attention.torch_backend import write_kv_cache
from tokenloom.plugins.attention.triton_backend import TritonAttention

pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []
PREFILL = triton_backend.prefill_attention  # the launcher itself, before any test wraps it


def _run(batch, kv_dtype, monkeypatch, **settings):
    """The backend's output over a quantized copy of the batch's cache, and the caches
    each prefill launch read (their dtypes)."""
    info = model_info(4, 2, 32, torch.float16, DEVICE)
    attn = TritonAttention(EngineConfig(), info, **settings)
    k_cache, v_cache = quantized_copy(batch, kv_dtype, attn.fp8_values_transposed)
    write_kv_cache(batch.k, batch.v, k_cache, v_cache, batch.meta.slot_mapping)
    launches = []

    def counted(q, k, v, tables, seq_lens, *args, **kwargs):
        # (the cache's dtype, the first request, the requests its tables hold)
        launches.append((k.dtype, kwargs["first_seq"], seq_lens.shape[0]))
        return PREFILL(q, k, v, tables, seq_lens, *args, **kwargs)

    monkeypatch.setattr(triton_backend, "prefill_attention", counted)
    batch.meta.extra.clear()
    attn.prepare(batch.meta)
    out = attn.forward(
        batch.q, batch.k, batch.v, k_cache, v_cache, batch.meta, batch.scale, kv_written=True
    )
    return out, launches


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_fresh_requests_attend_over_their_own_16bit_keys_and_values(kv_dtype, monkeypatch):
    # two decodes, a prompt's second chunk (60 tokens cached), two prompts with no prefix
    q_lens, seq_lens = [1, 1, 40, 50, 70], [120, 33, 100, 50, 70]
    batch = make_batch(q_lens, seq_lens, dtype=torch.float16, device=DEVICE, seed=3)
    plain, plain_launches = _run(batch, kv_dtype, monkeypatch)
    fresh, launches = _run(batch, kv_dtype, monkeypatch, prefill_fresh_16bit=1)
    assert batch.meta.extra["fresh_from"] == 3 and batch.meta.extra["fresh_max_len"] == 70
    assert plain_launches == [(kv_dtype, 2, 5)]  # off: one launch over the cache
    # the cache's launch holds the decodes and the continued prompt only
    assert launches == [(kv_dtype, 2, 3), (torch.float16, 3, 5)]
    # the decodes and the continued prompt read the cache as before, to the bit
    continued = 1 + 1 + 40
    assert torch.equal(fresh[:continued], plain[:continued])
    # the fresh prompts: the float attention over their 16-bit keys and values, to the
    # prefill kernel's f16 arithmetic; through the cache they carry its quantization
    ref = dense_reference(batch)[continued:]
    assert relative_error(fresh[continued:], ref) < AGREEMENT[torch.float16]
    assert relative_error(plain[continued:], ref) > AGREEMENT[torch.float16]


def test_a_batch_of_fresh_prompts_only_never_reads_the_cache(monkeypatch):
    batch = make_batch([30, 17], [30, 17], dtype=torch.float16, device=DEVICE, seed=1)
    out, launches = _run(batch, torch.float8_e4m3fn, monkeypatch, prefill_fresh_16bit=1)
    assert launches == [(torch.float16, 0, 2)]
    assert relative_error(out, dense_reference(batch)) < AGREEMENT[torch.float16]


def test_only_the_trailing_fresh_prompts_and_keys_of_other_strides(monkeypatch):
    # a fresh prompt before a continued one stays on the cache; the last one does not
    q_lens, seq_lens = [1, 30, 20, 25], [40, 30, 45, 25]
    batch = make_batch(q_lens, seq_lens, dtype=torch.float16, device=DEVICE, seed=2)
    plain, _ = _run(batch, torch.float8_e4m3fn, monkeypatch)
    # the values a view into a wider tensor (as from a fused q/k/v projection), the keys
    # contiguous (as after a rope that returns a new tensor): other row strides
    wide = torch.zeros(batch.v.shape[0], 3, *batch.v.shape[1:], dtype=batch.v.dtype)
    wide[:, 1] = batch.v.cpu()
    batch.v = wide.to(DEVICE)[:, 1]
    assert batch.v.stride() != batch.k.stride()
    fresh, launches = _run(batch, torch.float8_e4m3fn, monkeypatch, prefill_fresh_16bit=1)
    assert launches == [(torch.float8_e4m3fn, 1, 3), (torch.float16, 3, 4)]
    assert torch.equal(fresh[:51], plain[:51])  # the decode and the first two prompts
    ref = dense_reference(batch)[51:]
    assert relative_error(fresh[51:], ref) < AGREEMENT[torch.float16]


def test_no_fresh_request_or_a_16bit_cache_keeps_one_launch(monkeypatch):
    # every prompt continues a cached prefix: nothing fresh
    batch = make_batch([1, 20], [40, 45], dtype=torch.float16, device=DEVICE)
    _, launches = _run(batch, torch.int8, monkeypatch, prefill_fresh_16bit=1)
    assert "fresh_from" not in batch.meta.extra and launches == [(torch.int8, 1, 2)]
    # a fresh prompt over a 16-bit cache: the cache is already 16-bit, one launch
    batch = make_batch([1, 20], [40, 20], dtype=torch.float16, device=DEVICE)
    info = model_info(4, 2, 32, torch.float16, DEVICE)
    attn = TritonAttention(EngineConfig(), info, prefill_fresh_16bit=1)
    seen = []
    monkeypatch.setattr(
        triton_backend,
        "prefill_attention",
        lambda q, k, *a, **kw: seen.append(k.dtype) or PREFILL(q, k, *a, **kw),
    )
    attn.prepare(batch.meta)
    attn.forward(batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert seen == [torch.float16] and batch.meta.extra["fresh_from"] == 1


def test_a_capture_s_static_metadata_finds_nothing_fresh():
    # verify graphs capture with query lengths and no host sequence lengths
    batch = make_batch([3, 3], [10, 12], dtype=torch.float16, device=DEVICE)
    batch.meta.seq_lens_cpu = []
    attn = TritonAttention(
        EngineConfig(), model_info(4, 2, 32, torch.float16, DEVICE), prefill_fresh_16bit=1
    )
    attn.prepare(batch.meta)
    assert "fresh_from" not in batch.meta.extra
