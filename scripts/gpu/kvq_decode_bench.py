"""Decode attention over a bf16, fp8 or int8 KV cache at Llama-3-8B head shapes (issue 12).

For each KV dtype, batch size and context: one decode step per layer (KV write of the
new token, then the split-KV decode kernel) over ``LAYERS`` layers' caches, replayed
from a CUDA graph so the caches do not sit in L2; the median time per layer and the
bandwidth of the KV bytes read (data and scales). Each shape is first checked against
the torch reference path on the same quantized cache. The quantized cache reads about
half the bytes, so a bandwidth-bound decode should take about half the time.

    python scripts/gpu/kvq_decode_bench.py [--batches 1,32,128,256] [--contexts 1024,4096]
        [--page-size 16]

Prints a table and writes JSON to $OUT/kvq_decode_bench.json (or --json PATH).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable

import torch
import triton.testing

from tokenloom.config import EngineConfig
from tokenloom.plugins.attention import kv_quant
from tokenloom.plugins.attention.torch_backend import TorchAttention, write_kv_cache
from tokenloom.plugins.attention.triton_backend import TritonAttention
from tokenloom.protocols.components.attention import AttentionMetadata
from tokenloom.protocols.components.model import ModelInfo

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
BLOCK = 16  # tokens a cache page (the engine's block_size); --page-size sets it
MODEL_DTYPE = torch.bfloat16
DTYPES = {"auto": MODEL_DTYPE, "fp8": torch.float8_e4m3fn, "int8": torch.int8}
L2_ROTATION_BYTES = 512 * 10**6  # KV bytes per replay, well past the 60 MB L2


def info(device: str, dtype: torch.dtype = MODEL_DTYPE) -> ModelInfo:
    return ModelInfo(
        name="llama-3-8b-heads", architecture="LlamaForCausalLM", max_model_len=131072,
        vocab_size=128256, num_layers=1, num_heads=HEADS, num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM, hidden_size=HEADS * HEAD_DIM, dtype=dtype,
        device=torch.device(device),
    )  # fmt: skip


def build(
    batch: int, context: int, layers: int, kv: str, device: str, settings: dict[str, int]
) -> tuple[Callable[[], None], int, float]:
    """One decode step's attention over ``layers`` layers' caches (at least enough to read
    past L2), checked first against the torch path: (the step, its layers, its error)."""
    blocks_per_seq = -(-context // BLOCK)
    num_blocks = batch * blocks_per_seq + 1
    # enough layers that one replay reads more KV than L2 holds (in the model dtype)
    per_layer = 2 * num_blocks * kv_quant.block_bytes(BLOCK, KV_HEADS, HEAD_DIM, MODEL_DTYPE)
    layers = min(64, max(layers, -(-L2_ROTATION_BYTES // per_layer)))
    config = EngineConfig(max_num_seqs=max(batch, 1), block_size=BLOCK)
    attn = TritonAttention(config, info(device), **settings)
    pool, caches = kv_quant.allocate(
        layers, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, DTYPES[kv], torch.device(device),
        v_transposed=attn.fp8_values_transposed,  # the layout the backend reads, as the engine
    )  # fmt: skip
    gen = torch.Generator(device=device).manual_seed(0)
    fill = torch.randn(num_blocks * BLOCK, KV_HEADS, HEAD_DIM, generator=gen, device=device)
    slots_all = torch.arange(num_blocks * BLOCK, device=device)
    # a random history, quantized as the engine would, in layer 0; the rest copy it
    write_kv_cache(fill.to(MODEL_DTYPE), fill.to(MODEL_DTYPE), *caches[0], slots_all)
    del fill
    for layer in range(1, layers):
        pool[layer].copy_(pool[0])
    tables = torch.randperm(num_blocks - 1, generator=gen, device=device)[
        : batch * blocks_per_seq
    ].view(batch, blocks_per_seq).int()  # fmt: skip
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    last = (context - 1) % BLOCK
    slots = (tables[:, (context - 1) // BLOCK].long() * BLOCK + last).contiguous()
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=seq_lens,
        block_tables=tables,
        max_query_len=1,
        max_seq_len=context,
        decode_only=True,
        query_lens_cpu=[1] * batch,
        seq_lens_cpu=[context] * batch,
    )
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen, device=device).to(MODEL_DTYPE)
    k = torch.randn(batch, KV_HEADS, HEAD_DIM, generator=gen, device=device).to(MODEL_DTYPE)
    v = torch.randn(batch, KV_HEADS, HEAD_DIM, generator=gen, device=device).to(MODEL_DTYPE)
    attn.prepare(meta)
    scale = HEAD_DIM**-0.5
    out = attn.forward(q, k, v, *caches[0], meta, scale)
    ref = TorchAttention(EngineConfig(), info(device)).forward(
        q, k, v, *caches[0], meta, scale
    )  # same cache, same new token (written twice, same values)
    error = float((out.double() - ref.double()).norm() / ref.double().norm())
    # fp8 with fp8 products (decode_fp8_mma) rounds q and p too: test_kv_quant's bound
    bound = 8e-2 if kv == "fp8" and attn.resolved.decode_fp8_mma else 4e-2
    assert error < bound, f"{kv} batch {batch} context {context}: relative error {error:.3g}"

    def layer(k_cache: torch.Tensor, v_cache: torch.Tensor) -> Callable[[], None]:
        return lambda: attn.forward(q, k, v, k_cache, v_cache, meta, scale)

    steps = [layer(*kv_pair) for kv_pair in caches]

    def run() -> None:
        for one in steps:
            one()

    run.layers = steps  # type: ignore[attr-defined]  # each layer's step alone (overlap_probe)
    return run, layers, error


def step(
    batch: int, context: int, layers: int, kv: str, device: str, settings: dict[str, int]
) -> dict[str, float]:
    run, layers, error = build(batch, context, layers, kv, device, settings)
    graph = torch.cuda.CUDAGraph()
    run()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        run()
    ms = triton.testing.do_bench(graph.replay, warmup=25, rep=200)
    per_layer_us = ms * 1000 / layers
    read = 2 * batch * context * kv_quant.block_bytes(1, KV_HEADS, HEAD_DIM, DTYPES[kv])
    return {"layers": layers, "us_per_layer": per_layer_us, "kv_read_mb": read / 1e6,
            "gbps": read / (per_layer_us * 1e-6) / 1e9, "rel_error_vs_torch": error}  # fmt: skip


def main() -> int:
    global BLOCK
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", default="1,32,128,256")
    parser.add_argument("--contexts", default="1024,4096")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--page-size", type=int, default=BLOCK, help="tokens a cache page")
    parser.add_argument("--json", default=None)
    parser.add_argument("--kv", default=",".join(DTYPES), help="KV dtypes, of auto,fp8,int8")
    parser.add_argument(
        "--setting", action="append", default=[], help="backend setting NAME=INT (repeatable)"
    )
    args = parser.parse_args()
    BLOCK = args.page_size
    settings = {k: int(v) for k, v in (s.split("=", 1) for s in args.setting)}
    kvs = args.kv.split(",")
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            row: dict[str, object] = {"batch": batch, "context": context}
            for kv in kvs:
                row[kv] = step(batch, context, args.layers, kv, "cuda", settings)
                torch.cuda.empty_cache()  # the step's caches are gone: give their memory back
            for kv in ("fp8", "int8"):
                if kv in row and "auto" in row:
                    row[f"{kv}_speedup"] = row["auto"]["us_per_layer"] / row[kv]["us_per_layer"]
            rows.append(row)
            print(
                f"batch {batch:4d} context {context:5d}: "
                + "  ".join(
                    f"{kv} {row[kv]['us_per_layer']:7.1f} us {row[kv]['gbps']:6.0f} GB/s"
                    for kv in kvs
                )
                + "".join(
                    f"  {kv} x{row[kv + '_speedup']:.2f}"
                    for kv in ("fp8", "int8")
                    if kv + "_speedup" in row
                ),  # fmt: skip
                flush=True,
            )
    path = args.json or (os.path.join(os.environ["OUT"], "kvq_decode_bench.json")
                         if "OUT" in os.environ else None)  # fmt: skip
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "page_size": BLOCK, "rows": rows},
                      f, indent=2)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
