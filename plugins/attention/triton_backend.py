"""Attention plugin ``triton``: paged attention in Triton kernels (default on CUDA).

Each forward writes the new keys/values with one kernel (unless the model's rope
kernel already did: ``accepts_written_kv``; or, given ``rope`` (``accepts_rope``), the
decode kernel rotates q and k and stores them itself, ``decode_rope_min_batch``; on
other batches one rope kernel does it first), then runs the split-KV
decode kernel on the batch's leading one-token requests and the paged prefill kernel
on the rest (the executor should order decodes first in mixed batches; any order is
correct, but only leading decodes get the decode kernel). No launch reads tensor values on
the host, and the decode scratch buffers are allocated once at their largest size,
so decode steps can be captured in CUDA graphs. An fp8 / int8 cache (``kv_quant``) is
quantized by the write and dequantized inside both attention kernels.

Settings (``[plugin.triton]`` in the config, or keyword arguments), their defaults and
the measured tables in ``triton_settings.py`` (``resolve``, kept as ``self.resolved``): ``max_num_splits``, ``decode_block_n``, ``decode_num_stages``,
``decode_programs_per_sm``, ``decode_min_split_tokens``, ``decode_num_warps``,
``decode_kv_asm`` (an 8-bit cache converted by PTX helpers), ``decode_rope_min_batch``
(rope inside the decode kernel from this batch up), ``decode_prefetch_max_batch`` (the
first KV tile read before the PDL wait up to this batch), ``decode_heads_first``
(grid order), ``decode_maxnreg`` (register cap), ``decode_fp8_meta_ahead`` (the fp8-MMA
decode's block numbers a tile ahead), ``decode_fp8_fold`` (its one cross-warp reduction
a tile; on by default where ``MMA_DECODE`` applies), ``decode_fp8_mma`` (an fp8 cache's
decode with fp8 products over transposed value blocks, ``decode_fp8_mma.py``; on by
default on a GPU, off under the interpreter), ``prefill_block_m``, ``prefill_block_n``,
``prefill_num_warps``, ``prefill_num_stages``, ``prefill_kv_f16`` (an fp8 cache's
prefill products in f16 for 16-bit queries), ``prefill_fresh_16bit`` (with an 8-bit
cache, the prefill of the requests at a batch's end that have no cached prefix, over
their own 16-bit keys and values; off until measured), ``prefill_fp8_mma`` (an fp8
cache's prefill with fp8 products over its transposed value blocks, so only where
``decode_fp8_mma`` stores them so; ``prefill.py``'s ``KV_MMA8``; off, with a warning,
where it cannot apply), ``prefill_meta_ahead`` (0 or 1: an 8-bit cache's prefill loads its
unmasked tiles' blocks and scales a tile ahead). An 8-bit cache's decode takes
``QUANT_DECODE`` for the stages and register cap unless they are set (the fp8-MMA decode
``MMA_DECODE``'s tile, stages and cap), and an fp8 cache's prefill ``FP8_PREFILL``'s
tiles unless a prefill tile key is set.
Without a GPU the kernels run under ``TRITON_INTERPRET=1`` with small tiles.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec
import torch

from tokenloom.config import EngineConfig, plugin_settings
from tokenloom.plugins.attention import fresh_prefill, kv_quant
from tokenloom.plugins.attention.decode_scratch import DecodeScratch
from tokenloom.plugins.attention.triton_kernels import decode_fp8_mma
from tokenloom.plugins.attention.triton_kernels.decode import decode_attention
from tokenloom.plugins.attention.triton_kernels.decode_rope import DecodeRope
from tokenloom.plugins.attention.triton_kernels.kv_write import write_kv
from tokenloom.plugins.attention.triton_kernels.prefill import prefill_attention
from tokenloom.plugins.attention.triton_settings import TritonSettings, resolve
from tokenloom.plugins.models import rope_ops
from tokenloom.plugins.models.pdl import pdl_on
from tokenloom.protocols.components.attention import (
    AttentionBackend,
    AttentionMetadata,
    RopeInputs,
)
from tokenloom.protocols.components.model import ModelInfo
from tokenloom.protocols.components.registry import ComponentSpec
from tokenloom.protocols.hookspecs import hookimpl


def is_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


class TritonAttention(AttentionBackend):
    """Paged attention through Triton; see the module docstring for the kernels."""

    name = "triton"
    supports_cuda_graphs = True
    accepts_written_kv = True
    accepts_rope = True
    supports_quantized_kv = True
    supports_micro_batches = True  # a decode scratch per lane (DecodeScratch)

    def __init__(self, config: EngineConfig, model_info: ModelInfo, **overrides: int) -> None:
        self.num_heads = int(model_info.num_heads)
        self.num_kv_heads = int(model_info.num_kv_heads)
        self.head_dim = int(model_info.head_dim)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        self.device = torch.device(model_info.device)
        interpreted = is_interpreted()
        if self.device.type != "cuda" and not interpreted:
            raise RuntimeError(
                "attention 'triton' needs a CUDA device (or TRITON_INTERPRET=1 on the CPU); "
                "use attention = 'torch' here"
            )
        self.max_num_seqs = config.max_num_seqs
        settings = _plugin_settings(config)
        settings.update(overrides)
        self._fp8_ok = True
        if interpreted:
            self.num_sms = 4
        else:
            self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            # Triton reads fp8 e4m3 on sm_89 (Ada, Hopper) or later only
            self._fp8_ok = torch.cuda.get_device_capability(self.device) >= (8, 9)
        self.resolved = resolve(
            settings,
            head_dim=self.head_dim,
            group=self.num_heads // self.num_kv_heads,
            block_size=config.block_size,
            fp32_queries=model_info.dtype == torch.float32,
            interpreted=interpreted,
            pdl=interpreted or pdl_on(self.device),
        )
        # the split-KV decode's partials and counters, one set per micro-batch lane
        self.scratch = DecodeScratch(
            self.num_heads, self.num_kv_heads, self.head_dim, self.max_num_seqs, self.device,
            self.num_splits,
        )  # fmt: skip

    @property
    def fp8_values_transposed(self) -> bool:
        """An fp8 cache's value blocks stored transposed (the fp8-MMA decode reads them so);
        the model runner lays the cache out by it."""
        return self.resolved.decode_fp8_mma

    def num_splits(self, batch: int) -> int:
        """KV splits for a decode batch of ``batch`` requests: enough programs for
        ``decode_programs_per_sm`` per SM, a power of two, at most
        ``max_num_splits``. Depends on the batch size only (a shape), never on
        sequence lengths, so a graph captured for one batch size stays valid."""
        programs = batch * self.num_kv_heads
        wanted = max(1, -(-self.resolved.decode_programs_per_sm * self.num_sms // programs))
        return min(self.resolved.max_num_splits, 1 << (wanted - 1).bit_length())

    def decode_block_n_for(self, batch: int, quantized: bool = False) -> int:
        """KV tile of the decode kernel. Small batches run the most splits and each
        program's slice is long, where 64-token tiles measured faster; elsewhere 32.
        An 8-bit cache moves half the bytes per token: 128-token tiles (64 for heads
        above 128) keep each tile's bytes up, which measured 1.5x faster at 512 x 1,500
        on the H200 than 32-token ones (docs/performance.md)."""
        if self.resolved.decode_block_n:
            return self.resolved.decode_block_n
        if quantized and not is_interpreted():
            return 128 if self.head_dim <= 128 else 64
        if self.head_dim <= 128 and self.num_splits(batch) >= self.resolved.max_num_splits:
            return 64
        return 32

    def _prefetch(self, num_decodes: int, quantized: bool, rope: DecodeRope | None) -> bool:
        """The decode kernel's first KV tile before the PDL wait (``decode_tile.py``): up to
        ``decode_prefetch_max_batch`` requests, no rope in the kernel (it writes the new
        token), 16-bit caches (an 8-bit tile spills under ``QUANT_DECODE``'s cap)."""
        return (
            num_decodes <= self.resolved.decode_prefetch_max_batch
            and not quantized
            and rope is None
        )

    def _rope_in_decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> bool:
        """Whether the decode kernel rotates q and k and stores the new KV itself (one
        kernel less per layer): a decode-only batch of at least ``decode_rope_min_batch``
        requests, 16-bit or fp32 contiguous caches, a head size that is a power of two
        and at least 32 (the kernel's ``tl.dot`` over a half head needs K >= 16 on a GPU;
        the interpreter does not check it)."""
        return (
            meta.decode_only
            and q.shape[0] >= self.resolved.decode_rope_min_batch
            and not kv_quant.is_quantized(k_cache.dtype)
            and k_cache.is_contiguous()
            and v_cache.is_contiguous()
            and self.head_dim & (self.head_dim - 1) == 0
            and self.head_dim >= 32
        )

    def prepare(self, meta: AttentionMetadata) -> None:
        """Count the leading decodes of a mixed batch (host lists only) into
        ``meta.extra["num_leading_decodes"]``, and allocate the decode scratch outside
        any graph capture."""
        if meta.decode_only:
            num_decodes = int(meta.seq_lens.shape[0])
        else:
            num_decodes = 0
            for q_len in meta.query_lens_cpu:
                if q_len != 1:
                    break
                num_decodes += 1
            meta.extra["num_leading_decodes"] = num_decodes
            if self.resolved.prefill_fresh_16bit:
                fresh_prefill.find_fresh(meta, num_decodes)
        if num_decodes:
            self.scratch.get(num_decodes, int(meta.extra.get("lane", 0)))

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        kv_written: bool = False,
        rope: RopeInputs | None = None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        if k_cache.dtype == torch.float8_e4m3fn and not self._fp8_ok:
            raise RuntimeError(
                "an fp8 KV cache needs a GPU of compute capability 8.9 or later "
                "(Ada, Hopper); use kv_cache_dtype = 'int8' here"
            )
        decode_rope = None
        if rope is not None:  # q and k un-rotated: in the decode kernel, else one kernel here
            if self._rope_in_decode(q, k_cache, v_cache, meta):
                decode_rope = DecodeRope(k, v, *rope.as_tuple(), meta.slot_mapping)
            else:
                kv_write = (v, k_cache, v_cache, meta.slot_mapping)
                rope_ops.qk_norm_rope_(q, k, *rope.as_tuple(), kv_write)
            kv_written = True
        if not kv_written:
            write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        num_seqs = int(meta.seq_lens.shape[0])
        if meta.decode_only:
            num_decodes = num_seqs
        else:
            num_decodes = int(meta.extra.get("num_leading_decodes", 0))
        if num_decodes:
            quantized = kv_quant.is_quantized(k_cache.dtype)
            lane = int(meta.extra.get("lane", 0))
            part_out, part_lse, counters = self.scratch.get(num_decodes, lane)
            decode, r = decode_attention, self.resolved
            if r.decode_fp8_mma and decode_fp8_mma.supports(q, k_cache, v_cache):
                decode = self._decode_fp8_mma
            decode(
                q[:num_decodes],
                k_cache,
                v_cache,
                meta.block_tables[:num_decodes],
                meta.seq_lens[:num_decodes],
                out[:num_decodes],
                part_out,
                part_lse,
                counters,
                scale,
                num_splits=self.num_splits(num_decodes),
                block_n=self.decode_block_n_for(num_decodes, quantized),
                min_split_tokens=r.decode_min_split_tokens,
                num_warps=r.decode_num_warps,
                num_stages=r.quant_decode_num_stages if quantized else r.decode_num_stages,
                kv_asm=r.decode_kv_asm,
                heads_first=r.decode_heads_first,
                maxnreg=r.quant_decode_maxnreg if quantized else r.decode_maxnreg,
                rope=decode_rope,
                prefetch=self._prefetch(num_decodes, quantized, decode_rope),
            )
        fresh = num_seqs
        if kv_quant.is_quantized(k_cache.dtype) and not meta.decode_only:
            fresh = int(meta.extra.get("fresh_from", num_seqs))
        if num_decodes < fresh:  # over the cache
            end = None if fresh == num_seqs else fresh  # the fresh requests' tiles exit
            self._prefill(
                q, k_cache, v_cache, meta.block_tables[:end], meta.seq_lens[:end],
                meta.query_start_loc[: None if end is None else end + 1], out, scale,
                num_decodes,
            )  # fmt: skip
        if fresh < num_seqs:
            # requests with no cached prefix: their own 16-bit keys and values (rotated
            # above), read as a cache of one-token pages through a table of their rows
            k_pages, v_pages, table = fresh_prefill.page_view(k, v, meta)
            self._prefill(
                q, k_pages, v_pages, table, meta.seq_lens, meta.query_start_loc, out, scale,
                fresh,
            )  # fmt: skip
        return out

    def _prefill(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
        out: torch.Tensor, scale: float, first_seq: int,
    ) -> None:  # fmt: skip
        """``prefill_attention`` for requests ``first_seq:`` of these tables, with the
        cache dtype's tiles."""
        r = self.resolved
        tiles = r.prefill_tiles[k_cache.dtype == torch.float8_e4m3fn]
        prefill_attention(
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            out,
            scale,
            block_m=tiles["prefill_block_m"],
            block_n=tiles["prefill_block_n"],
            num_warps=tiles["prefill_num_warps"],
            num_stages=tiles["prefill_num_stages"],
            kv_f16=r.prefill_kv_f16,
            fp8_mma=r.prefill_fp8_mma,
            meta_ahead=r.prefill_meta_ahead,
            first_seq=first_seq,
        )

    def _decode_fp8_mma(self, *args: Any, **options: Any) -> None:
        """``decode_fp8_mma`` with ``decode_attention``'s arguments (the f16 kernel's
        conversion, rope and prefetch options do not apply: fp8 only, no rope), and its
        own stages and register cap."""
        for name in ("kv_asm", "rope", "prefetch"):
            options.pop(name)
        r = self.resolved
        if r.mma_decode_block_n:
            options["block_n"] = r.mma_decode_block_n
        options.update(
            num_stages=r.mma_decode_num_stages,
            maxnreg=r.mma_decode_maxnreg,
            meta_ahead=r.mma_decode_meta_ahead,
            fold=r.mma_decode_fold,
        )
        decode_fp8_mma.decode_fp8_mma(*args, **options)


def _plugin_settings(config: EngineConfig) -> dict[str, Any]:
    """The keys of ``[plugin.triton]`` that are set (checked against TritonSettings)."""
    table = msgspec.structs.asdict(plugin_settings(config, "triton", TritonSettings))
    return {key: value for key, value in table.items() if value is not None}


@hookimpl
def tokenloom_register_components() -> list[ComponentSpec]:
    return [
        ComponentSpec(
            "attention",
            "triton",
            TritonAttention,
            "Triton paged attention: split-KV decode with grouped heads, paged prefill",
            settings=TritonSettings,
        )
    ]
