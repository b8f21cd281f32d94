"""Benchmark the Triton attention kernels at Llama-3-8B shapes on one GPU.

Decode: 32 query heads, 8 KV heads, head_dim 128, bf16, block size 16, for each batch
size and context; the step (KV write, split-KV decode, merge) is replayed from a CUDA
graph that runs it over several layers' caches (so that small shapes do not sit in
L2), and the median time per layer is reported with the effective bandwidth of the
KV read against a measured device-to-device copy. Prefill: causal attention over
1 x 4096 and 8 x 1024 new tokens, in TFLOP/s, next to torch's SDPA on the same
tokens. Mixed (chunked-prefill) steps: decodes through the decode kernel versus every
row through the prefill kernel. Every shape is checked against the torch backend
before it is timed.

    python scripts/bench_attention.py [--batches 1,8,32] [--contexts 512,2048]

Prints a table and writes JSON to $OUT/bench_attention.json when OUT is set (or to
--json PATH).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from typing import Any

import msgspec
import torch
import torch.nn.functional as F
import triton.testing

from tokenloom.config import EngineConfig
from tokenloom.plugins.attention.torch_backend import TorchAttention
from tokenloom.plugins.attention.triton_backend import TritonAttention
from tokenloom.protocols.components.attention import AttentionMetadata
from tokenloom.protocols.components.model import ModelInfo

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
L2_ROTATION_BYTES = 512 * 2**20  # KV bytes per replay: well past the 60 MB L2
CHECK_TOLERANCE = 2e-2  # relative error vs the torch backend, bf16


def model_info(dtype: torch.dtype) -> ModelInfo:
    return ModelInfo(
        name="llama-3-8b-shapes",
        architecture="LlamaForCausalLM",
        max_model_len=131072,
        vocab_size=128256,
        num_layers=32,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        hidden_size=HEADS * HEAD_DIM,
        dtype=dtype,
        device=torch.device("cuda"),
    )


def copy_bandwidth_gbps() -> float:
    """Device-to-device copy of 2 GiB, counting bytes read plus bytes written."""
    src = torch.randn(2**29, device="cuda")  # 2 GiB fp32
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * 2**31 / (ms * 1e-3) / 1e9


def paged_step(query_lens: list[int], seq_lens: list[int], dtype: torch.dtype, seed: int):
    """Random q/k/v, caches and metadata with shuffled (non-contiguous) block tables."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks = [-(-s // BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(blocks) + 1
    perm = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device="cuda")
    slots = []
    start = 0
    for b, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        own = perm[start : start + blocks[b]]
        tables[b, : blocks[b]] = own
        pos = torch.arange(seq_len - q_len, seq_len, device="cuda")
        slots.append(own[pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE)
        start += blocks[b]
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
    v_cache = torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
    tokens = sum(query_lens)
    q = torch.randn(tokens, HEADS, HEAD_DIM, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(tokens, KV_HEADS, HEAD_DIM, device="cuda", dtype=dtype, generator=gen)
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        block_tables=tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        decode_only=all(n == 1 for n in query_lens),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
    )
    return q, k, v, k_cache, v_cache, meta


def check(attn: TritonAttention, step: tuple, dtype: torch.dtype) -> float:
    """Relative error of the Triton forward against the torch backend on copies."""
    q, k, v, k_cache, v_cache, meta = step
    scale = HEAD_DIM**-0.5
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    out = attn.forward(q, k, v, k_cache, v_cache, meta, scale).float()
    ref = TorchAttention(EngineConfig(), model_info(dtype)).forward(
        q, k, v, k_ref, v_ref, meta, scale
    )
    ref = ref.float()
    if not (torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)):
        return float("inf")
    del k_ref, v_ref
    return float((out - ref).norm() / ref.norm())


def bench_decode(attn: TritonAttention, batch: int, ctx: int, dtype: torch.dtype) -> dict:
    kv_bytes = batch * ctx * KV_HEADS * HEAD_DIM * 2 * dtype.itemsize
    layers = max(1, min(32, -(-L2_ROTATION_BYTES // kv_bytes)))
    steps = [paged_step([1] * batch, [ctx] * batch, dtype, seed=i) for i in range(layers)]
    error = check(attn, steps[0], dtype)
    scale = HEAD_DIM**-0.5
    attn.prepare(steps[0][5])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for q, k, v, kc, vc, meta in steps:
            attn.forward(q, k, v, kc, vc, meta, scale)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for q, k, v, kc, vc, meta in steps:
            attn.forward(q, k, v, kc, vc, meta, scale)
    ms = triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median")
    us = ms * 1e3 / layers
    del graph, steps
    return {
        "batch": batch,
        "context": ctx,
        "num_splits": attn.num_splits(batch),
        "block_n": attn.decode_block_n_for(batch),
        "layers_per_replay": layers,
        "us": us,
        "kv_bytes": kv_bytes,
        "gbps": kv_bytes / (us * 1e-6) / 1e9,
        "rel_error_vs_torch": error,
    }


def bench_prefill(attn: TritonAttention, num_seqs: int, length: int, dtype: torch.dtype) -> dict:
    step = paged_step([length] * num_seqs, [length] * num_seqs, dtype, seed=0)
    error = check(attn, step, dtype)
    q, k, v, kc, vc, meta = step
    scale = HEAD_DIM**-0.5
    ms = triton.testing.do_bench(
        lambda: attn.forward(q, k, v, kc, vc, meta, scale), warmup=25, rep=200,
        return_mode="median",
    )  # fmt: skip
    # QK^T and PV over the causal triangle: 2 matmuls * 2 flop per multiply-add.
    flops = num_seqs * 4 * HEADS * HEAD_DIM * length * (length + 1) / 2
    row = {
        "num_seqs": num_seqs,
        "length": length,
        "ms": ms,
        "tflops": flops / (ms * 1e-3) / 1e12,
        "rel_error_vs_torch": error,
    }
    try:  # torch SDPA (flash) on contiguous, unpaged tensors as a baseline
        qs = q.view(num_seqs, length, HEADS, HEAD_DIM).transpose(1, 2)
        ks = torch.randn(num_seqs, KV_HEADS, length, HEAD_DIM, device="cuda", dtype=dtype)
        vs = torch.randn_like(ks)
        sdpa_ms = triton.testing.do_bench(
            lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True),
            warmup=25, rep=200, return_mode="median",
        )  # fmt: skip
        row["sdpa_ms"] = sdpa_ms
        row["sdpa_tflops"] = flops / (sdpa_ms * 1e-3) / 1e12
    except Exception as exc:  # a baseline only: never fail the run for it
        row["sdpa_error"] = repr(exc)
    return row


def bench_mixed(attn: TritonAttention, decodes: int, ctx: int, chunk: int, dtype) -> dict:
    """A chunked-prefill step: ``decodes`` one-token requests at ``ctx`` first, then one
    ``chunk``-token prefill over a ``ctx`` prefix; with ``prepare`` the decodes take the
    decode kernel, without it every row goes through the prefill kernel."""
    step = paged_step([1] * decodes + [chunk], [ctx] * decodes + [ctx + chunk], dtype, seed=0)
    q, k, v, kc, vc, meta = step
    scale = HEAD_DIM**-0.5
    attn.prepare(meta)
    error = check(attn, step, dtype)
    split_ms = triton.testing.do_bench(
        lambda: attn.forward(q, k, v, kc, vc, meta, scale), warmup=25, rep=200,
        return_mode="median",
    )  # fmt: skip
    meta.extra["num_leading_decodes"] = 0
    unsplit_ms = triton.testing.do_bench(
        lambda: attn.forward(q, k, v, kc, vc, meta, scale), warmup=25, rep=200,
        return_mode="median",
    )  # fmt: skip
    return {
        "decodes": decodes,
        "context": ctx,
        "chunk": chunk,
        "us_decode_kernel_for_decodes": split_ms * 1e3,
        "us_prefill_kernel_for_all": unsplit_ms * 1e3,
        "rel_error_vs_torch": error,
    }


def resolved_settings(attn: TritonAttention) -> dict[str, Any]:
    """The backend's resolved settings for the JSON (the prefill tiles by cache kind)."""
    settings = msgspec.structs.asdict(attn.resolved)
    tiles = settings.pop("prefill_tiles")
    settings["prefill_tiles"] = {"fp8": tiles[True], "other": tiles[False]}
    return settings


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,8,32,128,256")
    parser.add_argument("--contexts", default="512,2048,8192")
    parser.add_argument("--prefill", default="1x4096,8x1024", help="NUM_SEQSxLENGTH,...")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--json", default=None, help="output path (default $OUT/...)")
    parser.add_argument(
        "--setting", action="append", default=[], help="backend setting NAME=INT (repeatable)"
    )
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--skip-prefill", action="store_true")
    args = parser.parse_args()
    if args.skip_decode:
        args.batches = ""
    if args.skip_prefill:
        args.prefill = ""
    if not torch.cuda.is_available():
        print("bench_attention: needs a CUDA GPU", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    settings = {k: int(v) for k, v in (s.split("=", 1) for s in args.setting)}
    attn = TritonAttention(EngineConfig(), model_info(dtype), **settings)
    props = torch.cuda.get_device_properties(0)
    copy_gbps = copy_bandwidth_gbps()
    result: dict[str, Any] = {
        "device": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": args.dtype,
        "settings": resolved_settings(attn),
        "copy_gbps": copy_gbps,
        "decode": [],
        "prefill": [],
    }
    print(f"{props.name}: device copy {copy_gbps:.0f} GB/s; settings {result['settings']}")
    print(f"{'batch':>6} {'ctx':>6} {'splits':>6} {'us':>9} {'GB/s':>7} {'%copy':>6} {'err':>8}")
    for batch in [int(x) for x in args.batches.split(",") if x]:
        for ctx in [int(x) for x in args.contexts.split(",")]:
            try:
                row = bench_decode(attn, batch, ctx, dtype)
                row["pct_of_copy"] = 100 * row["gbps"] / copy_gbps
                row["correct"] = row["rel_error_vs_torch"] < CHECK_TOLERANCE
                flag = "" if row["correct"] else "  WRONG"
                print(
                    f"{batch:>6} {ctx:>6} {row['num_splits']:>6} {row['us']:>9.1f} "
                    f"{row['gbps']:>7.0f} {row['pct_of_copy']:>5.0f}% "
                    f"{row['rel_error_vs_torch']:>8.1e}{flag}"
                )
            except Exception as exc:
                traceback.print_exc()
                row = {"batch": batch, "context": ctx, "error": repr(exc)}
                print(f"{batch:>6} {ctx:>6} failed: {exc!r}")
            result["decode"].append(row)
            torch.cuda.empty_cache()
    print(f"\n{'prefill':>10} {'ms':>8} {'TFLOP/s':>8} {'SDPA TFLOP/s':>13} {'err':>8}")
    for shape in [x for x in args.prefill.split(",") if x]:
        num_seqs, length = (int(n) for n in shape.split("x"))
        try:
            row = bench_prefill(attn, num_seqs, length, dtype)
            row["correct"] = row["rel_error_vs_torch"] < CHECK_TOLERANCE
            flag = "" if row["correct"] else "  WRONG"
            print(
                f"{num_seqs:>4}x{length:<5} {row['ms']:>8.3f} {row['tflops']:>8.1f} "
                f"{row.get('sdpa_tflops', float('nan')):>13.1f} "
                f"{row['rel_error_vs_torch']:>8.1e}{flag}"
            )
        except Exception as exc:
            traceback.print_exc()
            row = {"num_seqs": num_seqs, "length": length, "error": repr(exc)}
            print(f"{num_seqs:>4}x{length:<5} failed: {exc!r}")
        result["prefill"].append(row)
        torch.cuda.empty_cache()
    print(f"\n{'mixed step':>22} {'us split':>9} {'us all-prefill':>15} {'err':>8}")
    result["mixed"] = []
    for decodes, ctx, chunk in ((64, 2048, 512), (256, 1024, 256)):
        try:
            row = bench_mixed(attn, decodes, ctx, chunk, dtype)
            row["correct"] = row["rel_error_vs_torch"] < CHECK_TOLERANCE
            flag = "" if row["correct"] else "  WRONG"
            print(
                f"{decodes:>4} dec@{ctx:<5} + {chunk:>4} tok {row['us_decode_kernel_for_decodes']:>9.1f} "
                f"{row['us_prefill_kernel_for_all']:>15.1f} {row['rel_error_vs_torch']:>8.1e}{flag}"
            )
        except Exception as exc:
            traceback.print_exc()
            row = {"decodes": decodes, "context": ctx, "chunk": chunk, "error": repr(exc)}
            print(f"{decodes} decodes + {chunk} chunk failed: {exc!r}")
        result["mixed"].append(row)
        torch.cuda.empty_cache()
    path = args.json or (
        os.path.join(os.environ["OUT"], "bench_attention.json") if os.environ.get("OUT") else None
    )
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
