"""Random paged batches and a dense float64 reference for the attention tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenloom.protocols.components.attention import AttentionMetadata
from tokenloom.protocols.components.model import ModelInfo


def model_info(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: str):
    return ModelInfo(
        name="test",
        architecture="LlamaForCausalLM",
        max_model_len=4096,
        vocab_size=32,
        num_layers=1,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        hidden_size=num_heads * head_dim,
        dtype=dtype,
        device=torch.device(device),
    )


@dataclass
class PagedBatch:
    """One step's inputs: new q/k/v, caches holding random prefixes, metadata, and the
    full per-request keys/values the step must attend over."""

    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor  # [T, Hkv, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    meta: AttentionMetadata
    full_k: list[torch.Tensor]  # per request [seq_len, Hkv, D]
    full_v: list[torch.Tensor]
    scale: float

    def clone_caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_cache.clone(), self.v_cache.clone()


def make_batch(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    spare_blocks: int = 3,
    seed: int = 0,
    padding_rows: int = 0,
) -> PagedBatch:
    """Requests with ``query_lens[b]`` new tokens at the end of ``seq_lens[b]`` tokens.
    Blocks are drawn at random from a shuffled pool (non-contiguous tables); the cache
    starts random everywhere, so prefix keys are whatever sits in their slots.
    ``padding_rows`` appends decode rows with slot -1 and seq_len 0 (CUDA-graph padding)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max([*blocks_per_seq, 1])
    tables = torch.zeros(len(seq_lens) + padding_rows, max_blocks, dtype=torch.int32)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    k_cache = rand(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = rand(num_blocks, block_size, num_kv_heads, head_dim)
    total = sum(query_lens) + padding_rows
    q = rand(total, num_heads, head_dim)
    k = rand(total, num_kv_heads, head_dim)
    v = rand(total, num_kv_heads, head_dim)
    slots: list[int] = []
    full_k, full_v = [], []
    start = 0
    for b, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        own = [pool.pop() for _ in range(blocks_per_seq[b])]
        tables[b, : len(own)] = torch.tensor(own, dtype=torch.int32)
        seq_slots = [own[p // block_size] * block_size + p % block_size for p in range(seq_len)]
        slots += seq_slots[seq_len - q_len :]
        flat = torch.tensor(seq_slots, dtype=torch.long)
        keys = k_cache.flatten(0, 1)[flat].clone()
        values = v_cache.flatten(0, 1)[flat].clone()
        keys[seq_len - q_len :] = k[start : start + q_len]
        values[seq_len - q_len :] = v[start : start + q_len]
        full_k.append(keys)
        full_v.append(values)
        start += q_len
    slots += [-1] * padding_rows
    q_lens = list(query_lens) + [1] * padding_rows
    s_lens = list(seq_lens) + [0] * padding_rows
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        query_start_loc=qsl.to(device),
        seq_lens=torch.tensor(s_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        max_query_len=max(q_lens),
        max_seq_len=max(s_lens),
        decode_only=all(n == 1 for n in q_lens),
        query_lens_cpu=q_lens,
        seq_lens_cpu=s_lens,
    )
    return PagedBatch(
        q.to(device),
        k.to(device),
        v.to(device),
        k_cache.to(device),
        v_cache.to(device),
        meta,
        full_k,
        full_v,
        head_dim**-0.5,
    )


def dense_reference(batch: PagedBatch) -> torch.Tensor:  # [T_real, H, D] float64, cpu
    """Causal attention of each request's queries over its full keys/values, computed
    with an explicit softmax in float64; padding rows are left out."""
    outs = []
    start = 0
    heads = batch.q.shape[1]
    for q_len, keys, values in zip(
        batch.meta.query_lens_cpu, batch.full_k, batch.full_v, strict=False
    ):
        seq_len = keys.shape[0]
        q = batch.q[start : start + q_len].cpu().double()  # [q, H, D]
        group = heads // keys.shape[1]
        kk = keys.double().repeat_interleave(group, 1)  # [S, H, D]
        vv = values.double().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,shd->hqs", q, kk) * batch.scale
        pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        scores = scores.masked_fill(torch.arange(seq_len)[None, :] > pos, float("-inf"))
        outs.append(torch.einsum("hqs,shd->qhd", scores.softmax(-1), vv))
        start += q_len
    return torch.cat(outs)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64 = out.cpu().double()
    return float((out64 - ref).norm() / ref.norm())
