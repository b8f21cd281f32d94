"""The attention backend conformance suite, in one subclass.

    from tokenloom.testing import AttentionConformance

    class TestMyBackend(AttentionConformance):
        factory = MyBackend  # called as factory(config, model_info)

Each case builds a small paged KV cache with random blocks, a cached prefix per
request and this step's queries (decode-only, mixed prefill and decode, prefill
over a cached prefix, grouped-query heads), calls ``prepare`` then ``forward``, and
compares the output and the cache against a dense causal attention computed here
from scratch. ``device``/``dtype`` choose where it runs (CPU float32 by default; a
Triton backend runs on the CPU under ``TRITON_INTERPRET=1``, slowly: the cases are
tiny).

A backend declaring ``supports_quantized_kv`` also runs each case over an fp8 and an
int8 cache (``plugins.attention.kv_quant``'s layout): it must store the new keys and
values as ``kv_quant.quantize`` does (same scales; values within one step of the
format, where a rounding tie may go either way) and attend over the dequantized cache.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from typing import Any, ClassVar

import pytest

from tokenloom.config import EngineConfig
from tokenloom.protocols.components.attention import AttentionBackend, AttentionMetadata
from tokenloom.protocols.components.model import ModelInfo

# (query lengths, cached-prefix lengths, num_heads, num_kv_heads); decodes lead.
CASES = {
    "decode": ([1, 1, 1], [5, 0, 12], 4, 4),
    "mixed": ([1, 1, 6], [7, 3, 0], 4, 2),
    "prefill_over_prefix": ([5, 3], [8, 4], 4, 1),
}
BLOCK_SIZE = 4
HEAD_DIM = 16
NUM_BLOCKS = 24


class AttentionConformance:
    """Subclass it with ``factory`` set; see the module docstring."""

    factory: ClassVar[Callable[..., AttentionBackend]]
    device: ClassVar[str] = "cpu"
    dtype: ClassVar[str] = "float32"
    atol: ClassVar[float] = 2e-3

    @pytest.mark.parametrize("case", sorted(CASES))
    def test_forward_equals_dense_causal_attention(self, case: str) -> None:
        import torch

        backend, gen, meta, tables = self._setup(case)
        query_lens, context_lens, _, num_kv_heads = CASES[case]
        dtype, device = getattr(torch, self.dtype), torch.device(self.device)
        shape = (NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
        k_cache = torch.randn(shape, generator=gen).to(device, dtype)
        v_cache = torch.randn(shape, generator=gen).to(device, dtype)
        q, k, v = _step_inputs(CASES[case], gen, device, dtype)
        expected_k, expected_v = k_cache.clone(), v_cache.clone()
        flat_k, flat_v = expected_k.view(-1, *shape[2:]), expected_v.view(-1, *shape[2:])
        flat_k[meta.slot_mapping] = k
        flat_v[meta.slot_mapping] = v
        scale = HEAD_DIM**-0.5
        expected = _dense(q, expected_k, expected_v, tables, query_lens, context_lens, scale)

        backend.prepare(meta)
        out = backend.forward(q, k, v, k_cache, v_cache, meta, scale)
        assert out.shape == q.shape and out.dtype == q.dtype
        torch.testing.assert_close(out.float(), expected.float(), atol=self.atol, rtol=1e-2)
        torch.testing.assert_close(k_cache, expected_k)
        torch.testing.assert_close(v_cache, expected_v)

    @pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
    @pytest.mark.parametrize("case", sorted(CASES))
    def test_forward_over_a_quantized_cache(self, case: str, kv_cache_dtype: str) -> None:
        import torch

        from tokenloom.plugins.attention import kv_quant

        backend, gen, meta, tables = self._setup(case)
        if not backend.supports_quantized_kv:
            pytest.skip("the backend does not declare supports_quantized_kv")
        query_lens, context_lens, _, num_kv_heads = CASES[case]
        dtype, device = getattr(torch, self.dtype), torch.device(self.device)
        cache_dtype = kv_quant.KV_DTYPES[kv_cache_dtype]
        shape = (NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
        transposed = getattr(backend, "fp8_values_transposed", False)  # the backend's layout
        _, [caches] = kv_quant.allocate(1, *shape, cache_dtype, device, v_transposed=transposed)
        for cache in caches:  # a random quantized prefix in every slot
            data, scales = kv_quant.quantize(torch.randn(shape, generator=gen), cache_dtype)
            cache.view(torch.uint8).copy_(data.view(torch.uint8))
            kv_quant.scales_of(cache).copy_(scales)
        q, k, v = _step_inputs(CASES[case], gen, device, dtype)
        expected = []  # the reference's (data, scales) after the write
        for new, cache in zip((k, v), caches, strict=True):
            data, scales = cache.view(torch.uint8).clone(), kv_quant.scales_of(cache).clone()
            new_data, new_scales = kv_quant.quantize(new, cache_dtype)
            slots = meta.slot_mapping
            data[slots // BLOCK_SIZE, slots % BLOCK_SIZE] = new_data.view(torch.uint8)
            scales[slots // BLOCK_SIZE, slots % BLOCK_SIZE] = new_scales
            expected.append((data.view(cache_dtype), scales))

        scale = HEAD_DIM**-0.5
        backend.prepare(meta)
        out = backend.forward(q, k, v, *caches, meta, scale)
        for cache, (data, scales) in zip(caches, expected, strict=True):
            _assert_same_quantized(cache, data, scales)
        # Attention over what the backend stored (checked above), dequantized.
        k_deq, v_deq = (
            kv_quant.dequantize(c, kv_quant.scales_of(c), torch.float64) for c in caches
        )
        reference = _dense(q, k_deq, v_deq, tables, query_lens, context_lens, scale)
        assert out.shape == q.shape and out.dtype == q.dtype
        torch.testing.assert_close(out.float(), reference.float(), atol=self.atol, rtol=1e-2)

    def _setup(self, case: str) -> tuple[AttentionBackend, Any, AttentionMetadata, list[list[int]]]:
        """The backend, a generator seeded by the case, the step's metadata and tables."""
        import torch

        query_lens, context_lens, num_heads, num_kv_heads = CASES[case]
        dtype = getattr(torch, self.dtype)
        device = torch.device(self.device)
        info = ModelInfo(
            "conformance", "none", 64, 32, 1, num_heads, num_kv_heads, HEAD_DIM,
            num_heads * HEAD_DIM, dtype, device,
        )  # fmt: skip
        config = EngineConfig(device=self.device, dtype=self.dtype, block_size=BLOCK_SIZE)
        backend = type(self).factory(config, info)
        gen = torch.Generator().manual_seed(len(case))
        meta, tables = _metadata(query_lens, context_lens, device)
        return backend, gen, meta, tables


def _step_inputs(case: tuple[Any, ...], gen: Any, device: Any, dtype: Any) -> tuple[Any, Any, Any]:
    """This step's random queries, keys and values."""
    import torch

    query_lens, _, num_heads, num_kv_heads = case
    total = sum(query_lens)
    q = torch.randn((total, num_heads, HEAD_DIM), generator=gen).to(device, dtype)
    k = torch.randn((total, num_kv_heads, HEAD_DIM), generator=gen).to(device, dtype)
    v = torch.randn((total, num_kv_heads, HEAD_DIM), generator=gen).to(device, dtype)
    return q, k, v


def _assert_same_quantized(cache: Any, data: Any, scales: Any) -> None:
    """The backend's quantized cache against the reference's: scales to an fp32 ulp,
    values within one step of the format (int8: one scale; fp8 e4m3: 2^-3 relative,
    2^-9 of the scale among subnormals). Triton's interpreter mis-rounds an fp8 value
    whose rounding carries into the exponent (124.8 -> 64, not 128): allowed on the
    CPU under TRITON_INTERPRET=1 only."""
    import torch

    from tokenloom.plugins.attention import kv_quant

    torch.testing.assert_close(kv_quant.scales_of(cache), scales, rtol=2e-7, atol=0)
    got = kv_quant.dequantize(cache, scales, torch.float64)
    want = kv_quant.dequantize(data, scales, torch.float64)
    if cache.dtype == torch.int8:
        step = scales[..., None].double()
    else:
        step = want.abs() / 8 + scales[..., None].double() * 2**-9
    near = (got - want).abs() <= step * 1.001
    if cache.dtype != torch.int8 and cache.is_cpu and os.environ.get("TRITON_INTERPRET") == "1":
        stored, ref = cache.float(), data.float()
        near |= (stored * 2 == ref) & (torch.log2(ref.abs()) == torch.log2(ref.abs()).round())
    assert bool(near.all()), f"{int((~near).sum())} quantized values off by more than a step"


def _metadata(
    query_lens: list[int], context_lens: list[int], device: Any
) -> tuple[AttentionMetadata, list[list[int]]]:
    """Random distinct blocks per request; slots for each query token."""
    import torch

    blocks = list(range(1, NUM_BLOCKS))  # block 0 stays the padding block
    random.Random(sum(query_lens)).shuffle(blocks)
    tables: list[list[int]] = []
    slots: list[int] = []
    seq_lens = [q + c for q, c in zip(query_lens, context_lens, strict=True)]
    for ctx, seq_len in zip(context_lens, seq_lens, strict=True):
        table = [blocks.pop() for _ in range(-(-seq_len // BLOCK_SIZE))]
        tables.append(table)
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(ctx, seq_len)]
    width = max(len(t) for t in tables)
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(
            [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device
        ),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        decode_only=all(q == 1 for q in query_lens),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=seq_lens,
    )
    return meta, tables


def _dense(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    tables: list[list[int]],
    query_lens: list[int],
    context_lens: list[int],
    scale: float,
) -> Any:
    """Causal attention per request over its whole sequence, in float64."""
    import torch

    out = torch.empty_like(q)
    start = 0
    for table, q_len, ctx in zip(tables, query_lens, context_lens, strict=True):
        seq_len = ctx + q_len
        keys = k_cache[table].flatten(0, 1)[:seq_len].double()  # [S, Hkv, D]
        values = v_cache[table].flatten(0, 1)[:seq_len].double()
        group = q.shape[1] // keys.shape[1]
        keys = keys.repeat_interleave(group, dim=1)  # [S, H, D]
        values = values.repeat_interleave(group, dim=1)
        queries = q[start : start + q_len].double()  # [q_len, H, D]
        scores = torch.einsum("qhd,shd->hqs", queries, keys) * scale
        positions = torch.arange(ctx, seq_len, device=q.device)[:, None]
        visible = torch.arange(seq_len, device=q.device)[None, :] <= positions  # [q_len, S]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start : start + q_len] = torch.einsum("hqs,shd->qhd", scores.softmax(-1), values).to(
            q.dtype
        )
        start += q_len
    return out
