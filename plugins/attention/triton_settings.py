"""The ``triton`` attention plugin's settings (``[plugin.triton]``) and their defaults:
tiny tiles under the interpreter, tile configs measured on an H200 on CUDA, and the
8-bit cache's decode stages and register cap (``QUANT_DECODE``), the fp8-MMA decode's
tiles (``MMA_DECODE``) and an fp8 cache's prefill tiles (``FP8_PREFILL``)."""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from tokenloom.plugins.attention.triton_kernels import decode_fp8_mma

log = logging.getLogger("tokenloom.attention")


class TritonSettings(msgspec.Struct, forbid_unknown_fields=True):
    """``[plugin.triton]``: tile settings; None keeps the default for the device
    (measured per head size on CUDA, tiny tiles under the interpreter)."""

    max_num_splits: int | None = None
    decode_block_n: int | None = None
    decode_num_stages: int | None = None
    decode_programs_per_sm: int | None = None
    decode_min_split_tokens: int | None = None
    decode_num_warps: int | None = None
    decode_kv_asm: int | None = None
    decode_heads_first: int | None = None
    decode_maxnreg: int | None = None
    decode_rope_min_batch: int | None = None
    decode_prefetch_max_batch: int | None = None
    decode_fp8_mma: int | None = None
    decode_fp8_meta_ahead: int | None = None
    decode_fp8_fold: int | None = None
    prefill_block_m: int | None = None
    prefill_block_n: int | None = None
    prefill_num_warps: int | None = None
    prefill_num_stages: int | None = None
    prefill_kv_f16: int | None = None
    prefill_fresh_16bit: int | None = None
    prefill_fp8_mma: int | None = None
    prefill_meta_ahead: int | None = None


# Tiny tiles: the interpreter runs each program in Python.
INTERPRETER_DEFAULTS = {
    "max_num_splits": 4,
    "decode_block_n": 16,
    "decode_num_stages": 1,
    "decode_programs_per_sm": 4,
    "decode_min_split_tokens": 0,
    "decode_num_warps": 4,
    "decode_kv_asm": 0,  # the interpreter runs no PTX
    "decode_heads_first": 0,
    "decode_maxnreg": 0,
    "decode_rope_min_batch": 1,
    "decode_prefetch_max_batch": 0,  # tested directly (nothing overlaps in the interpreter)
    "decode_fp8_mma": 0,
    "decode_fp8_meta_ahead": 0,
    "decode_fp8_fold": 0,
    "prefill_block_m": 16,
    "prefill_block_n": 16,
    "prefill_num_warps": 4,
    "prefill_num_stages": 1,
    "prefill_kv_f16": 1,
    "prefill_fresh_16bit": 0,
    "prefill_fp8_mma": 0,
    "prefill_meta_ahead": 0,
}


def cuda_defaults(head_dim: int) -> dict[str, int]:
    """Tile configs measured on an H200 at Llama-3-8B shapes (scripts/bench_attention.py);
    head dims above 128 get smaller KV tiles to stay within shared memory."""
    big_head = head_dim > 128
    return {
        "max_num_splits": 32,
        "decode_block_n": 0,  # 0: chosen per batch size by decode_block_n_for
        "decode_num_stages": 2,
        "decode_programs_per_sm": 4,
        "decode_min_split_tokens": 0,
        "decode_num_warps": 4,
        "decode_kv_asm": 1,
        "decode_heads_first": 1,
        "decode_maxnreg": 0,  # 0: as many registers as ptxas wants
        # rope inside the decode kernel from this batch up: measured on the H200 slower at
        # batch 1 (qwen3-0.6b 0.79 -> 0.83 ms, llama-3-8b 4.11 -> 4.13), faster offline
        # (+4.1% qwen3, +0.5% llama at 100-256 running); 64 is a guess between the two
        # (two KV splits or fewer from there for 8 KV heads), not a measured crossover
        "decode_rope_min_batch": 64,
        # the first KV tile before the PDL wait (decode_tile.py): measured at batch 1 only
        "decode_prefetch_max_batch": 8,
        # an fp8 cache's decode with both products in fp8 on the tensor cores, over value
        # blocks stored transposed (decode_fp8_mma.py). Measured on the H200 (session 32,
        # Llama-3-8B, fp8 weights + fp8 KV): 600 x 1,000/1,000 12,879 -> 13,463 out tok/s,
        # decode attention per layer at batch 512 665 -> 602 us; batch 1 step 3.489 ->
        # 3.544 ms (12.2 -> 14.4 us a layer). Only an fp8 cache is affected.
        "decode_fp8_mma": 1,
        # its tiles' block numbers loaded a tile ahead, so Triton overlaps the copies from
        # 3 stages (session 35); on with MMA_DECODE's tiles (session 37), else off
        "decode_fp8_meta_ahead": 0,
        # one reduction across the warps a tile instead of three (decode_fp8_mma.py, FOLD;
        # session 38): offline at MMA_DECODE's tiles 9 -> 5 barriers and 455 -> 406
        # instructions a tile; one H200, per layer at 1,500 tokens 150.6 -> 144.4 us
        # (batch 128), 559.2 -> 523.3 us (512); the 600 x 1,000 / 1,000 workload 13,627 ->
        # 14,089 out tok/s. The backend applies it where MMA_DECODE was measured (head_dim
        # <= 128, 16-bit queries) unless the setting is given
        "decode_fp8_fold": 1,
        "prefill_block_m": 64,
        "prefill_block_n": 32 if big_head else 64,
        "prefill_num_warps": 4,
        "prefill_num_stages": 2 if big_head else 3,
        # an fp8 cache's prefill products in f16, not the queries' bf16 (session 37): one
        # conversion per element instead of two; on the H200 at 8 x 1,000 tokens 728 ->
        # 717 us a layer (-1.4%) at the default tiles. Not int8 (offline, its f16
        # conversion takes more instructions than Triton's bf16 one, and spills)
        "prefill_kv_f16": 1,
        # with an 8-bit cache, requests with no cached prefix attend over their own 16-bit
        # keys and values in the prefill (the bf16 tile ran at twice the fp8 tile's rate,
        # session 37), as vLLM's prefill does; written in session 38, not yet measured
        "prefill_fresh_16bit": 0,
        # an fp8 cache's prefill with both products in fp8 on the tensor cores, over its
        # transposed value blocks (prefill.py, KV_MMA8; session 52). One H100, pages of
        # 64, 8 x 1,000 tokens: 645.0 -> 573.1 us a layer, with the blocks and scales
        # ahead 578.7 -> 509.0 (2 x 4,000: 1,445.5 -> 1,198.8). Opt-in: rounding q and
        # p * v_scale to e4m3 in the prefill too costs perplexity (emulated on the CPU,
        # the built-in model: +0.51% -> +0.83% against the fp32 model; the bound is 1%)
        "prefill_fp8_mma": 0,
        # an 8-bit cache's prefill loads its unmasked tiles' blocks and scales a tile ahead,
        # in registers (prefill.py, AHEAD; session 52): on one H100 over an fp8 cache in
        # pages of 64 at Llama-3-8B heads, 645.0 -> 578.7 us a layer at 8 x 1,000 tokens,
        # 1,740.0 -> 1,445.5 at 2 x 4,000 (the same arithmetic, to the bit); an int8 cache
        # in pages of 16: 534.1 -> 469.1 / 1,595.1 -> 1,339.1 (carrying the blocks alone,
        # the scales left to Triton's pipeliner, gained nothing). Benches off / on (same H100):
        # fp8 + fp8 KV latency 3.9207 / 3.9204 ms, throughput 12,195.6 / 12,229.6 out
        # tok/s; bf16 + int8 KV 5.3781 / 5.3753 ms, 9,237.7 / 9,234.7. 16-bit caches have
        # no scales and never take it
        "prefill_meta_ahead": 1,
    }


# An 8-bit cache's decode tile (128 tokens) with one stage and at most 128 registers
# per thread: four programs per SM instead of three, 5-10% faster on the H200 at
# 32-512 x 1,500 with head_dim 128 and bf16 queries (docs/quantization.md). Applied
# there, and only where the user set neither key.
QUANT_DECODE = {"decode_num_stages": 1, "decode_maxnreg": 128}

# The fp8-MMA decode's tiles: 64 tokens, 3 stages (with decode_fp8_meta_ahead, three K/V
# buffers and a tile in flight), at most 128 registers. Session 37, one H200, fp8
# weights + fp8 KV at Llama-3-8B: per layer at 1,500 tokens 171.1 -> 152.0 us (batch
# 128), 602.6 -> 578.6 us (512); bench throughput 12,196 / 12,180 -> 12,262 / 12,254 out
# tok/s (two pairs), bench latency 3.552 -> 3.511 ms, the 600 x 1,000 / 1,000 workload
# 13,013 -> 13,044. Applied on CUDA (head_dim <= 128, 16-bit queries) where the user set
# none of its tile keys (decode_fp8_meta_ahead, when set, applies on its own).
MMA_DECODE = {
    "decode_block_n": 64,
    "decode_num_stages": 3,
    "decode_maxnreg": 128,
    "decode_fp8_meta_ahead": 1,
}


def mma_decode_tiles(
    settings: dict[str, int], defaults: dict[str, int], measured: bool, interpreted: bool
) -> tuple[int, int, int, bool]:
    """The fp8-MMA decode's (block_n, stages, register cap, block numbers ahead):
    ``MMA_DECODE`` where it was ``measured`` and none of its tile keys is set, else the
    settings (block_n 0: the backend's ``decode_block_n_for``; stages 1 interpreted, 2 on
    CUDA; no cap). ``decode_fp8_meta_ahead``, when set, applies on its own; ``defaults``
    is the device's table updated with ``settings``."""
    tile_keys = set(MMA_DECODE) - {"decode_fp8_meta_ahead"}
    mma = MMA_DECODE if measured and not tile_keys & set(settings) else {}
    stages = mma.get(
        "decode_num_stages", settings.get("decode_num_stages", 1 if interpreted else 2)
    )
    ahead = settings.get("decode_fp8_meta_ahead", mma.get("decode_fp8_meta_ahead"))
    return (
        int(mma.get("decode_block_n", 0)),
        int(stages),
        int(mma.get("decode_maxnreg", settings.get("decode_maxnreg", 0))),
        bool(defaults["decode_fp8_meta_ahead"] if ahead is None else ahead),
    )


# An fp8 cache's prefill tiles: two stages, not three. Session 37, one H200, the prefill
# attention of 8 prompts x 1,000 new tokens over an fp8 cache at Llama-3-8B heads
# (scripts/gpu/kvq_prefill_bench.py): 717 -> 656 us a layer (-8.5%; 728 us with bf16
# products before); 128-row tiles measured slower. int8 caches (unmeasured) keep the
# 16-bit cache's tiles.
FP8_PREFILL = {
    "prefill_block_m": 64,
    "prefill_block_n": 64,
    "prefill_num_warps": 4,
    "prefill_num_stages": 2,
}


def prefill_tiles(
    settings: dict[str, int], defaults: dict[str, int], measured: bool
) -> dict[bool, dict[str, int]]:
    """The prefill's tiles by whether the cache is fp8: ``FP8_PREFILL`` for an fp8 cache
    where it was ``measured`` (CUDA, head_dim <= 128, 16-bit queries) and none of its tile
    keys is set (``prefill_kv_f16`` is not one), else the settings for both."""
    plain = {key: int(defaults[key]) for key in FP8_PREFILL}
    fp8 = dict(plain)
    if measured and not set(FP8_PREFILL) & set(settings):
        fp8.update(FP8_PREFILL)
    return {False: plain, True: fp8}


SETTINGS: tuple[str, ...] = TritonSettings.__struct_fields__


class Resolved(msgspec.Struct):
    """What the backend launches with (``resolve``): the device's defaults under the
    user's keys, the measured tables where they apply, and the shape checks done. The
    16-bit decode reads ``decode_*``; an 8-bit cache's f16 decode ``quant_decode_*`` for
    its stages and cap; the fp8-MMA decode ``mma_decode_*`` (block_n 0: the backend's
    ``decode_block_n_for``); the prefill ``prefill_tiles`` by whether the cache is fp8.
    The launches read it each time (tests change fields to steer them); ``decode_fp8_mma``
    is also the fp8 cache's layout, which the model runner allocates once."""

    max_num_splits: int
    decode_block_n: int
    decode_num_stages: int
    decode_programs_per_sm: int
    decode_min_split_tokens: int
    decode_num_warps: int
    decode_kv_asm: bool
    decode_heads_first: bool
    decode_maxnreg: int
    decode_rope_min_batch: int
    decode_prefetch_max_batch: int
    decode_fp8_mma: bool  # also the fp8 cache's layout: values stored transposed
    quant_decode_num_stages: int
    quant_decode_maxnreg: int
    mma_decode_block_n: int
    mma_decode_num_stages: int
    mma_decode_maxnreg: int
    mma_decode_meta_ahead: bool
    mma_decode_fold: bool
    prefill_tiles: dict[bool, dict[str, int]]
    prefill_kv_f16: bool
    prefill_fresh_16bit: bool
    prefill_fp8_mma: bool
    prefill_meta_ahead: bool


def resolve(
    settings: dict[str, Any],
    *,
    head_dim: int,
    group: int,
    block_size: int,
    fp32_queries: bool,
    interpreted: bool,
    pdl: bool,
) -> Resolved:
    """The backend's ``Resolved`` settings from the keys the user set (``settings``), for
    a model of ``head_dim`` with ``group`` query heads per KV head, pages of
    ``block_size``, under the interpreter or on CUDA (``pdl``: programmatic dependent
    launch there). A setting that cannot apply is turned off with a warning; an unknown
    key or a ``prefill_meta_ahead`` other than 0 / 1 raises ValueError."""
    unknown = set(settings) - set(SETTINGS)
    if unknown:
        raise ValueError(f"plugin.triton: unknown settings {sorted(unknown)}")
    table = dict(INTERPRETER_DEFAULTS) if interpreted else cuda_defaults(head_dim)
    table.update(settings)
    if table["prefill_meta_ahead"] not in (0, 1):
        raise ValueError(
            f"plugin.triton.prefill_meta_ahead: 0 or 1, not {table['prefill_meta_ahead']}"
        )
    # the fp8-MMA decode, where the model's shape allows it, and the layout it reads
    shape_ok = decode_fp8_mma.supports_shape(head_dim, group, block_size)
    if settings.get("decode_fp8_mma") and not shape_ok:  # asked for, not the default
        log.warning(
            "plugin.triton.decode_fp8_mma: off for head_dim %d, %d query heads per KV "
            "head, block_size %d (needs a power of two >= 32, <= 16, a multiple of 16)",
            head_dim, group, block_size,
        )  # fmt: skip
    mma = bool(table["decode_fp8_mma"]) and shape_ok
    prefetch = int(table["decode_prefetch_max_batch"])
    if not interpreted and not pdl and "decode_prefetch_max_batch" not in settings:
        prefetch = 0  # nothing to overlap: only its registers
    # QUANT_DECODE where it was measured (CUDA, head_dim <= 128, 16-bit queries) and the
    # user set neither of its keys: a cap on its own, with two stages, only spills
    measured = not interpreted and head_dim <= 128 and not fp32_queries
    quant = QUANT_DECODE if measured and not set(QUANT_DECODE) & set(settings) else {}
    # the fp8-MMA decode's own tiles (MMA_DECODE where measured; QUANT_DECODE was tuned
    # for the f16 kernel), and its fold where measured or wherever the user asks for it
    mma_tiles = mma_decode_tiles(settings, table, measured, interpreted)
    fold = bool(table["decode_fp8_fold"]) and (measured or "decode_fp8_fold" in settings)
    # the prefill's tiles by whether the cache is fp8 (FP8_PREFILL where measured)
    tiles = prefill_tiles(settings, table, measured)
    # the fp8-MMA prefill reads the values transposed (as the fp8-MMA decode asks) with
    # 16-bit queries, and Triton's fp8 dots take K >= 32 (head_dim, the KV tile)
    mma_prefill_ok = (
        mma and not fp32_queries and min(head_dim, tiles[True]["prefill_block_n"]) >= 32
    )
    if settings.get("prefill_fp8_mma") and not mma_prefill_ok:
        log.warning(
            "plugin.triton.prefill_fp8_mma: off (needs decode_fp8_mma's transposed "
            "values, 16-bit queries, head_dim and an fp8 cache's prefill_block_n >= 32)"
        )
    return Resolved(
        max_num_splits=int(table["max_num_splits"]),
        decode_block_n=int(table["decode_block_n"]),
        decode_num_stages=int(table["decode_num_stages"]),
        decode_programs_per_sm=int(table["decode_programs_per_sm"]),
        decode_min_split_tokens=int(table["decode_min_split_tokens"]),
        decode_num_warps=int(table["decode_num_warps"]),
        decode_kv_asm=bool(table["decode_kv_asm"]) and not interpreted,  # no PTX there
        decode_heads_first=bool(table["decode_heads_first"]),
        decode_maxnreg=int(table["decode_maxnreg"]),
        decode_rope_min_batch=int(table["decode_rope_min_batch"]),
        decode_prefetch_max_batch=prefetch,
        decode_fp8_mma=mma,
        quant_decode_num_stages=int(quant.get("decode_num_stages", table["decode_num_stages"])),
        quant_decode_maxnreg=int(quant.get("decode_maxnreg", table["decode_maxnreg"])),
        mma_decode_block_n=mma_tiles[0],
        mma_decode_num_stages=mma_tiles[1],
        mma_decode_maxnreg=mma_tiles[2],
        mma_decode_meta_ahead=mma_tiles[3],
        mma_decode_fold=fold,
        prefill_tiles=tiles,
        prefill_kv_f16=bool(table["prefill_kv_f16"]),
        prefill_fresh_16bit=bool(table["prefill_fresh_16bit"]),
        prefill_fp8_mma=bool(table["prefill_fp8_mma"]) and mma_prefill_ok,
        prefill_meta_ahead=bool(table["prefill_meta_ahead"]),
    )
