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
"""

from __future__ import annotations

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
        shape = (NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
        k_cache = torch.randn(shape, generator=gen).to(device, dtype)
        v_cache = torch.randn(shape, generator=gen).to(device, dtype)
        meta, tables = _metadata(query_lens, context_lens, device)
        total = sum(query_lens)
        q = torch.randn((total, num_heads, HEAD_DIM), generator=gen).to(device, dtype)
        k = torch.randn((total, num_kv_heads, HEAD_DIM), generator=gen).to(device, dtype)
        v = torch.randn((total, num_kv_heads, HEAD_DIM), generator=gen).to(device, dtype)
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
