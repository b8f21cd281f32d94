"""Attention plugin ``torch``: the readable reference for paged attention.

Runs on any device. Keys and values are written into the paged cache with one
vectorised ``index_copy_``; then each request's keys and values are gathered through
its block table and attended with ``scaled_dot_product_attention`` under a causal mask
aligned to the end of the sequence (the queries are the request's last tokens).
Decode rows (one query a request) of requests of the same length attend in one call,
without a mask and without repeating the KV heads; each row's result is still its own
alone, whatever else is in the batch. It loops over requests on the host, reading
``meta.query_lens_cpu`` and ``meta.seq_lens_cpu``, so it is meant for correctness and
the CPU, not CUDA graphs.
A quantized cache (fp8 / int8, ``kv_quant``) is the reference path of KV
quantization: quantize on write, dequantize the gathered keys and values, attend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenloom.config import EngineConfig
from tokenloom.plugins.attention import kv_quant
from tokenloom.protocols.components.attention import AttentionBackend, AttentionMetadata
from tokenloom.protocols.components.model import ModelInfo
from tokenloom.protocols.components.registry import ComponentSpec
from tokenloom.protocols.hookspecs import hookimpl


def write_kv_cache(
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,  # [T, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
) -> None:
    """Store token ``t``'s key and value at flat slot ``slot_mapping[t]``; rows with a
    negative slot are skipped (the boolean mask syncs the host: reference only). A
    quantized cache gets the quantized rows and their scales."""
    keep = slot_mapping >= 0  # [T] bool
    slots = slot_mapping[keep]
    for new, cache in ((k[keep], k_cache), (v[keep], v_cache)):
        if not kv_quant.is_quantized(cache.dtype):
            flat = cache.view(-1, *cache.shape[2:])  # [num_slots, Hkv, D]
            flat.index_copy_(0, slots, new.to(cache.dtype))
            continue
        data, scales = kv_quant.quantize(new, cache.dtype)
        # fp8 has no index_copy_ on the CPU: copy the bytes. The data view is strided
        # (scales follow each block), so index the block and offset separately.
        block_size = cache.shape[1]
        blocks, offsets = slots // block_size, slots % block_size
        cache.view(torch.uint8)[blocks, offsets] = data.view(torch.uint8)
        kv_quant.scales_of(cache)[blocks, offsets] = scales


def gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [max_blocks_per_seq] int32
    seq_len: int,
) -> torch.Tensor:  # [seq_len, num_kv_heads, head_dim]
    """The first ``seq_len`` cached tokens of one request, in logical order; a
    quantized cache is dequantized to float32."""
    num_blocks = -(-seq_len // cache.shape[1])
    return gather_blocks(cache, block_table[:num_blocks].long()).flatten(0, 1)[:seq_len]


def gather_blocks(cache: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The cache blocks ``ids`` (int64, any shape): ``[*ids.shape, block_size,
    num_kv_heads, head_dim]``; a quantized cache is dequantized to float32."""
    if kv_quant.is_quantized(cache.dtype):
        data = cache.view(torch.uint8)[ids].view(cache.dtype)  # [*ids, bs, Hkv, D]
        scales = kv_quant.scales_of(cache)[ids]  # [*ids, bs, Hkv]
        return kv_quant.dequantize(data, scales, torch.float32)
    return cache.index_select(0, ids.flatten()).view(*ids.shape, *cache.shape[1:])


def causal_mask(q_len: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """``[q_len, seq_len]`` bool, True where query ``i`` (at position
    ``seq_len - q_len + i``) may see key ``j``."""
    query_pos = torch.arange(seq_len - q_len, seq_len, device=device)
    key_pos = torch.arange(seq_len, device=device)
    return key_pos[None, :] <= query_pos[:, None]


class TorchAttention(AttentionBackend):
    """Reference paged attention; GQA through ``repeat_interleave`` of the KV heads
    (decode rows: the query heads of a KV head attend together)."""

    name = "torch"
    supports_quantized_kv = True
    supports_micro_batches = True  # no scratch: each launch allocates its own

    def __init__(self, config: EngineConfig, model_info: ModelInfo) -> None:
        self.num_heads = int(model_info.num_heads)
        self.num_kv_heads = int(model_info.num_kv_heads)
        self.head_dim = int(model_info.head_dim)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        self.group = self.num_heads // self.num_kv_heads

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.zeros_like(q)
        decodes: dict[int, tuple[list[int], list[int]]] = {}  # seq_len -> (rows, requests)
        start = 0
        for b, (q_len, seq_len) in enumerate(
            zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)
        ):
            end = start + q_len
            if q_len == 1 and seq_len > 0:
                rows, requests = decodes.setdefault(seq_len, ([], []))
                rows.append(start)
                requests.append(b)
            elif q_len > 0 and seq_len > 0:
                out[start:end] = self._attend(
                    q[start:end], k_cache, v_cache, meta.block_tables[b], seq_len, scale
                )
            start = end
        for seq_len, (rows, requests) in decodes.items():
            index = torch.tensor(rows, device=q.device)
            tables = meta.block_tables[torch.tensor(requests, device=q.device)]
            out[index] = self._decode(q[index], k_cache, v_cache, tables, seq_len, scale)
        return out

    def _decode(
        self,
        q: torch.Tensor,  # [B, num_heads, head_dim]: one query row a request
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [B, max_blocks_per_seq] int32
        seq_len: int,  # every request's
        scale: float,
    ) -> torch.Tensor:  # [B, num_heads, head_dim]
        """Decode rows of requests of one length, in one call: each row sees all its
        request's keys (no mask), and the ``group`` query heads of a KV head attend
        together (no repeated keys). Each request's result is computed alone, whatever
        else is in the batch."""
        b, _, d = q.shape
        ids = block_tables[:, : -(-seq_len // k_cache.shape[1])].long()  # [B, nb]
        keys, values = (
            gather_blocks(c, ids).flatten(1, 2)[:, :seq_len].to(q.dtype).transpose(1, 2)
            for c in (k_cache, v_cache)
        )  # [B, Hkv, S, D]
        out = F.scaled_dot_product_attention(
            q.view(b, self.num_kv_heads, self.group, d), keys, values, scale=scale
        )  # [B, Hkv, group, D]
        return out.reshape(b, self.num_heads, d)

    def _attend(
        self,
        q: torch.Tensor,  # [q_len, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,  # [max_blocks_per_seq] int32
        seq_len: int,
        scale: float,
    ) -> torch.Tensor:  # [q_len, num_heads, head_dim]
        keys = gather_kv(k_cache, block_table, seq_len).to(q.dtype)  # [S, Hkv, D]
        values = gather_kv(v_cache, block_table, seq_len).to(q.dtype)  # [S, Hkv, D]
        if self.group > 1:
            keys = keys.repeat_interleave(self.group, dim=1)  # [S, H, D]
            values = values.repeat_interleave(self.group, dim=1)  # [S, H, D]
        mask = causal_mask(q.shape[0], seq_len, q.device)  # [q_len, S]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),  # [H, q_len, D]
            keys.transpose(0, 1),  # [H, S, D]
            values.transpose(0, 1),  # [H, S, D]
            attn_mask=mask,
            scale=scale,
        )  # [H, q_len, D]
        return out.transpose(0, 1)


@hookimpl
def tokenloom_register_components() -> list[ComponentSpec]:
    return [
        ComponentSpec(
            "attention", "torch", TorchAttention, "reference paged attention in plain PyTorch"
        )
    ]
