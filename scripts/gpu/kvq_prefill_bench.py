"""Prefill attention over a bf16 or fp8 KV cache at Llama-3-8B head shapes (issue 12).

Session 37's H200 profile of issue 12's workload (fp8 weights + fp8 KV, 600 x 1,000 /
1,000) put the prefill kernel at 1.33 ms a layer in an 8,192-token chunk (28.6% of the
chunk's GPU time), about 10x the floor its FLOPs allow. This times one layer's
attention forward (the KV write of the new tokens, then the prefill kernel) for
``NUM_SEQS`` prompts of ``LENGTH`` new tokens each, no cached prefix, as the workload's
chunks are, for each cache dtype and each setting variant; each shape is first checked
against the torch reference path over the same cache.

    python scripts/gpu/kvq_prefill_bench.py [--shapes 8x1000] [--kv auto,fp8]
        [--variant NAME:prefill_block_m=128,prefill_num_warps=8 ...]

Prints a table (median ms, TFLOP/s of the causal products) and writes JSON to --json
PATH (or $OUT/kvq_prefill_bench.json).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import triton.testing
from kvq_decode_bench import info  # this folder is on sys.path: the script's own

from tokenloom.config import EngineConfig
from tokenloom.plugins.attention import kv_quant
from tokenloom.plugins.attention.torch_backend import TorchAttention
from tokenloom.plugins.attention.triton_backend import TritonAttention
from tokenloom.protocols.components.attention import AttentionMetadata

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
BLOCK = 16  # tokens a cache page (the engine's block_size); --page-size sets it
MODEL_DTYPE = torch.bfloat16
DEVICE = "cuda"  # --device cpu: a check under TRITON_INTERPRET=1, timed by the wall clock
DTYPES = {"auto": MODEL_DTYPE, "fp8": torch.float8_e4m3fn, "int8": torch.int8}


def run(num_seqs: int, length: int, kv: str, settings: dict[str, int]) -> dict[str, float]:
    config = EngineConfig(max_num_seqs=num_seqs, block_size=BLOCK)
    attn = TritonAttention(config, info(DEVICE, MODEL_DTYPE), **settings)
    blocks_per_seq = -(-length // BLOCK)
    num_blocks = num_seqs * blocks_per_seq + 1
    _, caches = kv_quant.allocate(
        1, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, DTYPES[kv], torch.device(DEVICE),
        v_transposed=attn.fp8_values_transposed,  # the layout the backend reads
    )  # fmt: skip
    k_cache, v_cache = caches[0]
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    tables = torch.randperm(num_blocks - 1, generator=gen, device=DEVICE)[
        : num_seqs * blocks_per_seq
    ].view(num_seqs, blocks_per_seq).int()  # fmt: skip
    pos = torch.arange(length, device=DEVICE)
    slots = (tables[:, pos // BLOCK].long() * BLOCK + pos % BLOCK).reshape(-1)
    tokens = num_seqs * length
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32, device=DEVICE) * length,
        seq_lens=torch.full((num_seqs,), length, dtype=torch.int32, device=DEVICE),
        block_tables=tables,
        max_query_len=length,
        max_seq_len=length,
        decode_only=False,
        query_lens_cpu=[length] * num_seqs,
        seq_lens_cpu=[length] * num_seqs,
    )
    q = torch.randn(tokens, HEADS, HEAD_DIM, generator=gen, device=DEVICE).to(MODEL_DTYPE)
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen, device=DEVICE).to(MODEL_DTYPE)
    v = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen, device=DEVICE).to(MODEL_DTYPE)
    scale = HEAD_DIM**-0.5
    attn.prepare(meta)
    out = attn.forward(q, k, v, k_cache, v_cache, meta, scale)
    ref = TorchAttention(EngineConfig(), info(DEVICE, MODEL_DTYPE)).forward(
        q, k, v, k_cache, v_cache, meta, scale
    )
    error = float((out.double() - ref.double()).norm() / ref.double().norm())
    # fp8 products (prefill_fp8_mma) round q and p * v_scale to e4m3: about 4% on random
    # data, as the fp8-MMA decode (tests/plugins/attention/test_kv_quant.py)
    bound = 8e-2 if kv == "fp8" and settings.get("prefill_fp8_mma") else 4e-2
    assert error < bound, f"{kv} {num_seqs}x{length} {settings}: relative error {error:.3g}"
    if DEVICE == "cuda":
        ms = triton.testing.do_bench(
            lambda: attn.forward(q, k, v, k_cache, v_cache, meta, scale), warmup=25, rep=200,
            return_mode="median",
        )  # fmt: skip
    else:
        start = time.perf_counter()
        attn.forward(q, k, v, k_cache, v_cache, meta, scale)
        ms = (time.perf_counter() - start) * 1e3
    # QK^T and PV over the causal triangle: 2 products x 2 flop a multiply-add
    flops = num_seqs * 4 * HEADS * HEAD_DIM * length * (length + 1) / 2
    return {"ms": ms, "tflops": flops / (ms * 1e-3) / 1e12, "rel_error_vs_torch": error}


def main() -> int:
    global BLOCK
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default="8x1000", help="NUM_SEQSxLENGTH,...")
    parser.add_argument("--kv", default="auto,fp8", help="KV dtypes, of auto,fp8,int8")
    parser.add_argument(
        "--variant", action="append", default=[],
        help="NAME:SETTING=INT,... (repeatable); 'default' (no settings) always runs first",
    )  # fmt: skip
    parser.add_argument("--json", default=None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--page-size", type=int, default=BLOCK, help="tokens a cache page")
    args = parser.parse_args()
    global DEVICE, MODEL_DTYPE
    DEVICE = args.device
    BLOCK = args.page_size
    if DEVICE == "cpu":  # the interpreter's bf16 products are wrong, its e4m3 too
        MODEL_DTYPE = DTYPES["auto"] = torch.float16
        import sys

        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
        from interpreter_e4m3 import install

        install()
    variants: list[tuple[str, dict[str, int]]] = [("default", {})]
    for spec in args.variant:
        name, _, body = spec.partition(":")
        variants.append((name, {k: int(v) for k, v in (kv.split("=") for kv in body.split(","))}))
    rows = []
    for shape in args.shapes.split(","):
        num_seqs, length = (int(x) for x in shape.split("x"))
        for kv in args.kv.split(","):
            for name, settings in variants:
                try:
                    row = run(num_seqs, length, kv, settings)
                except Exception as exc:  # a variant that fails to compile or check
                    print(f"{shape} {kv:4s} {name:24s} failed: {exc!r}"[:300], flush=True)
                    rows.append({"shape": shape, "kv": kv, "variant": name, "error": repr(exc)})
                    continue
                rows.append({"shape": shape, "kv": kv, "variant": name, **settings, **row})
                print(
                    f"{shape} {kv:4s} {name:24s} {row['ms'] * 1000:8.1f} us "
                    f"{row['tflops']:6.1f} TFLOP/s  err {row['rel_error_vs_torch']:.2e}",
                    flush=True,
                )
                torch.cuda.empty_cache()
    path = args.json or (
        os.path.join(os.environ["OUT"], "kvq_prefill_bench.json") if "OUT" in os.environ else None
    )
    if path:
        gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"gpu": gpu, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
