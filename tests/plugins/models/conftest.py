"""Helpers for the model tests: a reference paged attention backend and a runner
that drives a model over a flat batch the way the executor does."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
import torch.nn.functional as F

from tokenloom.protocols.components.attention import (
    AttentionBackend,
    AttentionMetadata,
    ForwardContext,
)
from tokenloom.protocols.components.model import ModelInfo


class DenseAttention(AttentionBackend):
    """Test-only paged attention: per request, gather its KV from the block table and
    run dense causal attention. Slow and readable; follows the forward contract."""

    name = "dense-test"

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):
        block_size = k_cache.shape[1]
        flat_k = k_cache.view(-1, *k_cache.shape[2:])  # [slots, Hkv, D]
        flat_v = v_cache.view(-1, *v_cache.shape[2:])
        flat_k[meta.slot_mapping] = k
        flat_v[meta.slot_mapping] = v
        out = torch.empty_like(q)
        group = q.shape[1] // k.shape[1]
        for b, (query_len, seq_len) in enumerate(
            zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)
        ):
            start = int(meta.query_start_loc[b])
            pos = torch.arange(seq_len, device=q.device)
            slots = meta.block_tables[b, pos // block_size].long() * block_size + pos % block_size
            keys = flat_k[slots].repeat_interleave(group, dim=1)  # [S, Hq, D]
            values = flat_v[slots].repeat_interleave(group, dim=1)
            queries = q[start : start + query_len]  # [Q, Hq, D]
            q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)
            mask = pos[None, :] <= q_pos[:, None]  # [Q, S]
            attn = F.scaled_dot_product_attention(
                queries.transpose(0, 1),
                keys.transpose(0, 1),
                values.transpose(0, 1),
                attn_mask=mask,
                scale=scale,
            )
            out[start : start + query_len] = attn.transpose(0, 1)
        return out


def _torch_backend(info: ModelInfo) -> AttentionBackend:
    from tokenloom.config import EngineConfig
    from tokenloom.plugins.attention.torch_backend import TorchAttention

    return TorchAttention(EngineConfig(), info)


def _has_torch_backend() -> bool:
    try:
        import tokenloom.plugins.attention.torch_backend  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(
    params=[
        "dense",
        pytest.param(
            "torch",
            marks=pytest.mark.skipif(
                not _has_torch_backend(), reason="tokenloom.plugins.attention.torch_backend absent"
            ),
        ),
    ]
)
def attention_kind(request: pytest.FixtureRequest) -> str:
    return request.param


class PagedRunner:
    """Runs steps of a flat batch through a model with a paged KV cache: each request
    owns contiguous blocks, enough for ``max_len`` tokens."""

    def __init__(
        self,
        model,
        info: ModelInfo,
        attention_kind: str,
        num_requests: int,
        max_len: int = 64,
        block_size: int = 4,
    ) -> None:
        self.model, self.block_size, self.device = model, block_size, info.device
        self.computed: dict[int, int] = {}  # request index -> tokens in the KV cache
        self.attn = DenseAttention() if attention_kind == "dense" else _torch_backend(info)
        blocks_per_request = -(-max_len // block_size)
        num_blocks = num_requests * blocks_per_request + 1  # block 0 stays unused
        shape = (num_blocks, block_size, info.num_kv_heads, info.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=info.dtype, device=self.device),
                torch.zeros(shape, dtype=info.dtype, device=self.device),
            )
            for _ in range(info.num_layers)
        ]
        self.block_tables = torch.arange(1, num_blocks, dtype=torch.int32, device=self.device).view(
            num_requests, blocks_per_request
        )

    @torch.inference_mode()
    def step(self, requests: Sequence[tuple[int, Sequence[int]]]) -> torch.Tensor:
        """``requests``: (request index, token ids of this step) where the step's tokens
        follow the ones earlier steps computed. Returns logits [T, vocab]."""
        ids, positions, slots, query_lens, seq_lens, tables = [], [], [], [], [], []
        for index, tokens in requests:
            start = self.computed.get(index, 0)
            pos = list(range(start, start + len(tokens)))
            ids += tokens
            positions += pos
            table = self.block_tables[index]
            slots += [
                int(table[p // self.block_size]) * self.block_size + p % self.block_size
                for p in pos
            ]
            query_lens.append(len(tokens))
            seq_lens.append(start + len(tokens))
            tables.append(table)
            self.computed[index] = start + len(tokens)
        loc = torch.tensor([0, *query_lens], device=self.device).cumsum(0, dtype=torch.int32)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            query_start_loc=loc,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=self.device),
            block_tables=torch.stack(tables),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            decode_only=all(n == 1 for n in query_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        self.attn.prepare(meta)
        ctx = ForwardContext(attn=self.attn, meta=meta, kv_caches=self.kv_caches)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        hidden = self.model(
            input_ids, torch.tensor(positions, dtype=torch.int64, device=self.device), ctx
        )
        return self.model.compute_logits(hidden)


@pytest.fixture
def paged_runner(attention_kind: str):
    """``make(model, info, num_requests) -> PagedRunner`` using the parametrized backend."""

    def make(model, info: ModelInfo, num_requests: int) -> PagedRunner:
        return PagedRunner(model, info, attention_kind, num_requests)

    return make
